#!/usr/bin/env bash
# q42's DES runs (docs/results/q42.md): q33's configurations and commands, on the engine model whose
# CPU tier follows vLLM 0.32's offloading manager (tests/vllm/test_sim_parity.py), seeds 29231-29260.
# Usage: bash docs/results/q42/run.sh OUT
set -euo pipefail
out=${1:?usage: run.sh OUT}
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
S=$(seq -s, 29231 29260)
B=(nice -n 19 "$py" -m loadtest.bench_quality --block-size 128 --conversations 1 --concurrency 128
  --tail-reference kv_fixed_credit@fcfs --jobs 2 --seeds "$S")
R="kv_fixed_credit@fcfs,kv_fixed_credit:cpu=0.5:storage=0.1@fcfs"
K="kv_fixed_credit@priority:20:inf+escalate:40:route"
Q="tier_cost:pressure_s_at_full=1@priority:20:inf+escalate:40:route"
"${B[@]}" --fleet hetero --storage unbounded --storage-spread 1 \
  --policies "$R,kv_fixed_credit@priority:20:inf+escalate:20:route,tier_cost:pressure_s_at_full=1@priority:20:inf+escalate:20:route" \
  --out "$out/b1b.md"
for st in none 1/4 1/2; do
  f=$(echo $st | tr / -)
  "${B[@]}" --storage "$st" --policies "$R,$K,$Q" --out "$out/$f.md"
done
"$py" -m loadtest.frontier "$out/b1b.jsonl" --md "$out/b1b-frontier.md"
"$py" -m loadtest.frontier "$out/b1b.jsonl" --resolution 5 --md "$out/b1b-resolution5.md"
"$py" -m loadtest.frontier "$out/none.jsonl" "$out/1-4.jsonl" "$out/1-2.jsonl" --md "$out/b1-frontier.md"
"$py" -m loadtest.frontier "$out/none.jsonl" "$out/1-4.jsonl" "$out/1-2.jsonl" --resolution 5 --md "$out/b1-resolution5.md"
