#!/usr/bin/env bash
# q41's DES runs (docs/results/q41.md): q40's two live cells in the simulator, q38's D4(2) engines.
# Usage: bash docs/results/q41/run.sh OUT SEEDS
set -euo pipefail
out=${1:?usage: run.sh OUT SEEDS}
seeds=${2:?}
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
"$py" docs/results/q41/profile.py "$out/profile.json"
common=(--workload ladder --concurrency 48 --duration-s 30 --turns 5 --first-prompt-tokens 1800
  --system-tokens 454 --tokens-per-turn 368 --answer-tokens 48,48 --think-time-s 2.0 --block-size 32
  --engines 2 --gpu-blocks 1239 --cpu-ratio 2 --engine-variation 0 --jobs 2 --no-progress
  --router-priors nominal --engine-profile "$out/profile.json")
order=(--scheduling-policy priority --priority-stretch 20 --priority-max-overtake-s inf
  --escalate-after-s 1.35 --escalate-pick route)
K=kv_fixed_credit
Q=tier_cost:pressure_s_at_full=1
for seed in ${seeds//,/ }; do
  for cell in none pool; do
    if [ "$cell" = none ]; then st=(--storage none); else st=(--storage unbounded --storage-bandwidth none); fi
    run() { nice -n 19 "$py" -m sim.des_cli "${common[@]}" "${st[@]}" --seed "$seed" --out "$out/$cell-$1-$seed" "${@:2}" >/dev/null; }
    run fcfs --scheduling-policy fcfs --policies "$K"
    run order "${order[@]}" --policies "$K,$Q"
  done
done
