#!/usr/bin/env bash
# q53's tuning runs (docs/results/q53.md): q48's tuning on steady-load cells (three waves of 128
# conversations read over the middle one), E in {5,10,20,40,80}, B1 none, 1/4 and 1/2, seeds 29406-29410.
# Usage: bash docs/results/q53/tune.sh OUT
set -euo pipefail
SEEDS=$(seq -s, 29406 29410) ES="5 10 20 40 80" SHAPE="--conversations 3 --read steady" B1B=skip \
  exec bash "$(dirname "$0")/../q43/tune.sh" "$@"
