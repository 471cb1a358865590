#!/usr/bin/env bash
# q48's tuning runs (docs/results/q48.md): q43's tuning with E in {10,20,40,80}, seeds 29381-29390.
# Usage: bash docs/results/q48/tune.sh OUT
set -euo pipefail
SEEDS=$(seq -s, 29381 29390) ES="10 20 40 80" exec bash "$(dirname "$0")/../q43/tune.sh" "$@"
