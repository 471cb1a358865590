"""q41's engine model (docs/results/q41.md): q38's D4(S = 2) (q36's engine core slowed 2-fold), with
the CPU tier's load bandwidth the host-copy tier measured (docs/results/cpu-tier.md: 0.75-1.11 GB/s,
0.9e9 taken) and the STORAGE pool's at q40's router prior (5e8, not measured).

    python docs/results/q41/profile.py OUT.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = HERE.parent / "q36" / "profile.json"
S = 2.0  # q38's fit on tuning seeds 100-104
TIMES = ("step_overhead_s", "prefill_attention_s_per_token_ctx", "decode_s_per_seq")
RATES = ("prefill_tokens_per_s", "hbm_bytes_per_s")


def main() -> None:
    fields = dict(json.loads(BASE.read_text())["engine_profile"])
    for key in TIMES:
        fields[key] *= S
    for key in RATES:
        fields[key] /= S
    fields["cpu_load_bytes_per_s"] = 0.9e9
    fields["storage_load_bytes_per_s"] = 5e8
    Path(sys.argv[1]).write_text(json.dumps({"engine_profile": fields}, indent=2) + "\n")


if __name__ == "__main__":
    main()
