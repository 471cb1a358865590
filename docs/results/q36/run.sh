#!/usr/bin/env bash
# q36's DES runs (docs/results/q36.md): q35d's live setting in the simulator, three engine models,
# the report seeds 29201-29210. Usage: bash docs/results/q36/run.sh OUT [SEEDS]
set -euo pipefail
out=${1:?usage: run.sh OUT [SEEDS]}
seeds=${2:-$(seq -s, 29201 29210)}
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
# Locust's ladder as the live engines counted it (q35d's turns: 1,800 tokens, +368 a turn, a
# 454-token system prompt), 48 users, conversations started for 30 s; two engines of 1,239
# usable blocks (1,240 minus vLLM's null block), no CPU tier, no storage.
common=(--workload ladder --concurrency 48 --duration-s 30 --turns 5 --first-prompt-tokens 1800
  --system-tokens 454 --tokens-per-turn 368 --answer-tokens 48,48 --think-time-s 2.0 --block-size 32
  --engines 2 --gpu-blocks 1239 --cpu-ratio 0 --storage none --engine-variation 0 --jobs 2 --no-progress)
order=(--scheduling-policy priority --priority-stretch 20 --priority-max-overtake-s inf)
escalate=(--escalate-after-s 1.35 --escalate-pick route)
K=kv_fixed_credit
Q=tier_cost:pressure_s_at_full=1
declare -A models=(
  [D1]="--engine-profile docs/results/q36/profile.json"
  [D2]="--engine-profile docs/results/q36/profile.json --server-stages docs/results/q36/profile.json"
  [D3]="--engine-profile docs/results/q36/profile.json --server-stages docs/results/q36/profile-w.json"
)
for seed in ${seeds//,/ }; do
  for m in D1 D2 D3; do
    read -r -a model <<<"${models[$m]}"
    run() { nice -n 19 "$py" -m sim.des_cli "${common[@]}" "${model[@]}" --seed "$seed" --out "$out/$m-$1-$seed" "${@:2}" >/dev/null; }
    run fcfs --scheduling-policy fcfs --policies "$K"
    run order "${order[@]}" --policies "$K,$Q"
    if [ "$m" = D1 ]; then run escalate "${order[@]}" "${escalate[@]}" --policies "$K,$Q"; fi
  done
done
