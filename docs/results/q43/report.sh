#!/usr/bin/env bash
# q43's report runs (docs/results/q43.md): R, K and Q at each cell's chosen E, seeds 29271-29300
# (SEEDS=a,b,... for another set: q44 ran it on 29301-29330).
# Usage: [SEEDS=...] [SHAPE="--conversations 3 --read steady"] [B1B=skip] bash docs/results/q43/report.sh OUT E_NONE E_QUARTER E_HALF E_B1B
# (SHAPE, default "--conversations 1": q53 read three waves over the middle one).
set -euo pipefail
out=${1:?usage: report.sh OUT E_NONE E_QUARTER E_HALF E_B1B}
declare -A E=([none]=${2:?} [1/4]=${3:?} [1/2]=${4:?} [b1b]=${5:?})
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
S=${SEEDS:-$(seq -s, 29271 29300)}
B=(nice -n 19 "$py" -m loadtest.bench_quality --block-size 128 ${SHAPE:---conversations 1} --concurrency 128
  --tail-reference kv_fixed_credit@fcfs --jobs 2 --seeds "$S")
R="kv_fixed_credit@fcfs,kv_fixed_credit:cpu=0.5:storage=0.1@fcfs"
pol() { echo "$R,kv_fixed_credit@priority:20:inf+escalate:$1:route,tier_cost:pressure_s_at_full=1@priority:20:inf+escalate:$1:route"; }
for st in none 1/4 1/2; do
  f=$(echo $st | tr / -)
  "${B[@]}" --storage "$st" --policies "$(pol "${E[$st]}")" --out "$out/$f.md"
done
[ "${B1B:-run}" = skip ] || "${B[@]}" --fleet hetero --storage unbounded --storage-spread 1 --policies "$(pol "${E[b1b]}")" --out "$out/b1b.md"
"$py" -m loadtest.frontier "$out/none.jsonl" "$out/1-4.jsonl" "$out/1-2.jsonl" --md "$out/b1-frontier.md"
[ "${B1B:-run}" = skip ] || "$py" -m loadtest.frontier "$out/b1b.jsonl" --md "$out/b1b-frontier.md"
"$py" -m loadtest.frontier "$out/none.jsonl" "$out/1-4.jsonl" "$out/1-2.jsonl" --resolution 5 --md "$out/b1-resolution5.md"
[ "${B1B:-run}" = skip ] || "$py" -m loadtest.frontier "$out/b1b.jsonl" --resolution 5 --md "$out/b1b-resolution5.md"
