#!/usr/bin/env bash
# q54's runs (docs/results/q54.md): the shared STORAGE pool's read queue (+readq) on and off,
# steady-load B1 1/2 and 1/4, seeds 29417-29421. The round ran at 08042b5, where +readq booked the
# reads only; since b384998 it books the write-through too, and +readq:reads is the
# reads-only form this script now names (the same runs at HEAD).
# Usage: bash docs/results/q54/run.sh OUT
set -euo pipefail
out=${1:?usage: run.sh OUT}
cd "$(dirname "$0")/../../.."
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
B=(nice -n 19 "$py" -m loadtest.bench_quality --block-size 128 --conversations 3 --read steady --concurrency 128
  --tail-reference kv_fixed_credit@fcfs --jobs 2 --seeds "$(seq -s, 29417 29421)")
Q=tier_cost:pressure_s_at_full=1@priority:20:inf
K=kv_fixed_credit@priority:20:inf
"${B[@]}" --storage 1/2 --out "$out/1-2.md" --policies \
  "kv_fixed_credit@fcfs,$K+escalate:20:route,$Q+escalate:20:route,$Q+escalate:20:route+readq:reads,$Q+escalate:5:route,$Q+escalate:5:route+readq:reads"
"${B[@]}" --storage 1/4 --out "$out/1-4.md" --policies \
  "kv_fixed_credit@fcfs,$K+escalate:20:route,$Q+escalate:20:route,$Q+escalate:20:route+readq:reads"
"$py" docs/results/q54/ratios.py "$out/1-2.jsonl" "$out/1-4.jsonl" > "$out/ratios.md"
