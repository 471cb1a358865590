#!/usr/bin/env bash
# q38's DES runs (docs/results/q38.md): q36's D1 with the engine core slowed S-fold.
# Usage: bash docs/results/q38/run.sh OUT SEEDS S [escalate]
set -euo pipefail
out=${1:?usage: run.sh OUT SEEDS S [escalate]}
seeds=${2:?}
s=${3:?}
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
"$py" docs/results/q38/scaled.py "$out/profiles" "$s"
common=(--workload ladder --concurrency 48 --duration-s 30 --turns 5 --first-prompt-tokens 1800
  --system-tokens 454 --tokens-per-turn 368 --answer-tokens 48,48 --think-time-s 2.0 --block-size 32
  --engines 2 --gpu-blocks 1239 --cpu-ratio 0 --storage none --engine-variation 0 --jobs 2 --no-progress
  --engine-profile "$out/profiles/s$s.json")
order=(--scheduling-policy priority --priority-stretch 20 --priority-max-overtake-s inf)
escalate=(--escalate-after-s 1.35 --escalate-pick route)
K=kv_fixed_credit
Q=tier_cost:pressure_s_at_full=1
for seed in ${seeds//,/ }; do
  run() { nice -n 19 "$py" -m sim.des_cli "${common[@]}" --seed "$seed" --out "$out/D1-$1-$seed" "${@:2}" >/dev/null; }
  run fcfs --scheduling-policy fcfs --policies "$K"
  if [ "${4:-}" = escalate ]; then
    run order "${order[@]}" --policies "$K,$Q"
    run escalate "${order[@]}" "${escalate[@]}" --policies "$K,$Q"
  fi
done
