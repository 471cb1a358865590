"""Diagnosis (not pre-registered): q35d's setting, the explain probe on tier_cost (Q0) and
kv_fixed_credit (K0) at the order, on a priority fleet of 2 vLLM CPU engines of 1,240 blocks."""
import json, subprocess, sys, tempfile
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, '/work/main')
from loadtest.bench_quality_live import VLLM_PROFILE, reset_prefix_caches
from loadtest.load import kvroute_router
from sim.vllm_cpu import VllmCpuFleet
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
cfgs = {"Q0": ("tier_cost", "docs/results/q35/n.toml"), "K0": ("kv_fixed_credit", "docs/results/q37/k0.toml")}
with VllmCpuFleet(Path(tempfile.mkdtemp(prefix="probe-"))) as fleet:
    fleet.start(2, replace(VLLM_PROFILE, gpu_blocks=1240, scheduling_policy="priority"))
    for rep in range(2):
        for name, (policy, cfg) in (cfgs.items() if rep == 0 else reversed(cfgs.items())):
            reset_prefix_caches(fleet.engines)
            work = Path(tempfile.mkdtemp(prefix=f"probe-{name}-"))
            extra = ["--tokenizer-path", str(fleet.model_dir), "--config", cfg]
            with kvroute_router(fleet, policy, work, tokenizer="hf", extra=extra) as url:
                res = subprocess.run([sys.executable, "-m", "loadtest.explain_probe", "--url", url,
                    "--model", fleet.engines[0].model, "--users", "48", "--conversations", "2",
                    "--out", str(out / f"{name}-{rep}.jsonl")], capture_output=True, text=True, cwd="/work/main")
                (out / f"{name}-{rep}.json").write_text(res.stdout)
                print(name, rep, res.returncode, res.stdout[-3000:], res.stderr[-500:], flush=True)
