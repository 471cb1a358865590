#!/usr/bin/env bash
# q53's report runs (docs/results/q53.md): R, K and Q at each cell's chosen E on steady-load cells,
# B1 none, 1/4 and 1/2, seeds 29411-29416.
# Usage: bash docs/results/q53/report.sh OUT E_NONE E_QUARTER E_HALF
set -euo pipefail
out=${1:?usage: report.sh OUT E_NONE E_QUARTER E_HALF}
SEEDS=$(seq -s, 29411 29416) SHAPE="--conversations 3 --read steady" B1B=skip \
  exec bash "$(dirname "$0")/../q43/report.sh" "$out" "${2:?}" "${3:?}" "${4:?}" -
