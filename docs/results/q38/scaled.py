"""q38's engine models (docs/results/q38.md): q36's D1 engine profile with every time term
multiplied by S (the engine core slowed S-fold by the host it shares), one file per S.

    python docs/results/q38/scaled.py OUT_DIR S [S ...]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = HERE.parent / "q36" / "profile.json"
#: Seconds per unit: multiplied by S. A rate (per second): divided by S.
TIMES = ("step_overhead_s", "prefill_attention_s_per_token_ctx", "decode_s_per_seq")
RATES = ("prefill_tokens_per_s", "hbm_bytes_per_s")


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    base = json.loads(BASE.read_text())["engine_profile"]
    for arg in sys.argv[2:]:
        s = float(arg)
        fields = dict(base)
        for key in TIMES:
            fields[key] = base[key] * s
        for key in RATES:
            fields[key] = base[key] / s
        (out / f"s{arg}.json").write_text(json.dumps({"engine_profile": fields}, indent=2) + "\n")


if __name__ == "__main__":
    main()
