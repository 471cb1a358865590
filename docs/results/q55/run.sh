#!/usr/bin/env bash
# q55's runs (docs/results/q55.md): q53's configurations in steady-load B1 1/4 on thirty fresh
# seeds 29422-29451 (R, K and Q at E = 20).
# Usage: bash docs/results/q55/run.sh OUT
set -euo pipefail
out=${1:?usage: run.sh OUT}
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
nice -n 19 "$py" -m loadtest.bench_quality --block-size 128 --conversations 3 --read steady --concurrency 128 \
  --tail-reference kv_fixed_credit@fcfs --jobs 2 --seeds "$(seq -s, 29422 29451)" --storage 1/4 \
  --policies "kv_fixed_credit@fcfs,kv_fixed_credit:cpu=0.5:storage=0.1@fcfs,kv_fixed_credit@priority:20:inf+escalate:20:route,tier_cost:pressure_s_at_full=1@priority:20:inf+escalate:20:route" \
  --out "$out/1-4.md"
"$py" -m loadtest.frontier "$out/1-4.jsonl" --md "$out/frontier.md"
