#!/usr/bin/env bash
# q43's tuning runs (docs/results/q43.md): E in {10,15,20,25} for K and Q, four cells, seeds 29261-29270.
# Usage: [SEEDS=a,b,...] [ES="E1 E2 ..."] [SHAPE="--conversations 3 --read steady"] [B1B=skip] bash docs/results/q43/tune.sh OUT
# (q48 ran it on other seeds and Es; q53 with SHAPE: three waves read over the middle one).
set -euo pipefail
out=${1:?usage: tune.sh OUT}
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
S=${SEEDS:-$(seq -s, 29261 29270)}
B=(nice -n 19 "$py" -m loadtest.bench_quality --block-size 128 ${SHAPE:---conversations 1} --concurrency 128
  --tail-reference kv_fixed_credit@fcfs --jobs 2 --seeds "$S")
R="kv_fixed_credit@fcfs,kv_fixed_credit:cpu=0.5:storage=0.1@fcfs"
P=$R
for e in ${ES:-10 15 20 25}; do
  P="$P,kv_fixed_credit@priority:20:inf+escalate:$e:route,tier_cost:pressure_s_at_full=1@priority:20:inf+escalate:$e:route"
done
for st in none 1/4 1/2; do
  f=$(echo $st | tr / -)
  "${B[@]}" --storage "$st" --policies "$P" --out "$out/$f.md"
done
[ "${B1B:-run}" = skip ] || "${B[@]}" --fleet hetero --storage unbounded --storage-spread 1 --policies "$P" --out "$out/b1b.md"
"$py" -m loadtest.frontier "$out/none.jsonl" "$out/1-4.jsonl" "$out/1-2.jsonl" --md "$out/b1-frontier.md"
[ "${B1B:-run}" = skip ] || "$py" -m loadtest.frontier "$out/b1b.jsonl" --md "$out/b1b-frontier.md"
