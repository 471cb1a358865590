"""q38's diagnosis (not pre-registered; docs/results/q38.md): in q35d's setting, the explain probe
(loadtest/explain_probe.py) on Q0 (tier_cost at the order) and K0 (kv_fixed_credit at the order),
two runs each, interleaved, a fresh router per run after emptying the prefix caches, on a priority
fleet of 2 vLLM CPU engines of 1,240 blocks started here.

    python docs/results/q38/probe.py OUT"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from loadtest.bench_quality_live import VLLM_PROFILE, reset_prefix_caches  # noqa: E402
from loadtest.load import kvroute_router  # noqa: E402
from sim.vllm_cpu import VllmCpuFleet  # noqa: E402

CONFIGS = {
    "Q0": ("tier_cost", REPO / "docs/results/q35/n.toml"),
    "K0": ("kv_fixed_credit", REPO / "docs/results/q37/k0.toml"),
}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    with VllmCpuFleet(Path(tempfile.mkdtemp(prefix="probe-"))) as fleet:
        fleet.start(2, replace(VLLM_PROFILE, gpu_blocks=1240, scheduling_policy="priority"))
        for rep in range(2):
            order = list(CONFIGS.items()) if rep == 0 else list(reversed(CONFIGS.items()))
            for name, (policy, config) in order:
                reset_prefix_caches(fleet.engines)
                work = Path(tempfile.mkdtemp(prefix=f"probe-{name}-"))
                extra = ["--tokenizer-path", str(fleet.model_dir), "--config", str(config)]
                with kvroute_router(fleet, policy, work, tokenizer="hf", extra=extra) as url:
                    args = ["--url", url, "--model", fleet.engines[0].model, "--users", "48"]
                    args += ["--conversations", "2", "--out", str(out / f"{name}-{rep}.jsonl")]
                    res = subprocess.run(
                        [sys.executable, "-m", "loadtest.explain_probe", *args],
                        capture_output=True,
                        text=True,
                        cwd=REPO,
                        check=True,
                    )
                    (out / f"{name}-{rep}.json").write_text(res.stdout)
                    print(name, rep, "done", flush=True)


if __name__ == "__main__":
    main()
