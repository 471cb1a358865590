"""The simulator against real vLLM with a STORAGE tier behind the CPU tier (not yet a test: they
differ). tests/vllm/test_sim_parity.py's 150 prompts, one at a time, into one vLLM CPU-build engine
with a CPU tier and vLLM's ``fs`` tier on a fresh folder (sim/vllm_host_offload.py's tiering spec),
and into ``sim.engine.EngineCore`` with the same pools and an unbounded StoragePool (the fs tier never
evicts). Prints the requests whose cached tokens by tier (GPU, CPU, STORAGE) differ.

    PYTHONPATH=. python docs/results/cpu-tier/parity_storage.py [CPU_BLOCKS]   # default 80

The CPU tier must hold the largest prompt (63 blocks): with 40 blocks vLLM's engine stalled on a
prompt it had to promote from the fs tier through a CPU tier too small for it (2026-12-05).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from sim.cache import StoragePool
from sim.vllm_cpu import VllmCpuFleet, VllmCpuProfile
from tests.vllm.test_sim_parity import GPU_BLOCKS, MAX_MODEL_LEN, _live, _simulated, _workload


def main() -> None:
    cpu_blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 80
    prompts = _workload(2026, 150)
    workdir = Path(tempfile.mkdtemp(prefix="parity-storage-"))
    fleet = VllmCpuFleet(workdir)
    try:
        fleet.prepare()
        (engine,) = fleet.start(
            1,
            VllmCpuProfile(
                gpu_blocks=GPU_BLOCKS,
                cpu_blocks=cpu_blocks,
                storage_dir=str(workdir / "pool"),
                max_model_len=MAX_MODEL_LEN,
                enforce_eager=True,
                startup_timeout_s=900,
                extra_args=("--max-num-batched-tokens", str(MAX_MODEL_LEN)),
            ),
        )
        live = _live(engine, prompts, tiers=3)
    finally:
        fleet.stop()
    sim = _simulated(prompts, cpu_blocks, StoragePool("fs", 10**7), tiers=3)
    differ = [i for i, (a, b) in enumerate(zip(live, sim, strict=True)) if a != b]
    print(f"{len(differ)} of {len(prompts)} requests differ (GPU, CPU, STORAGE cached tokens)")
    for i in differ:
        print(f"{i:3d} prompt {len(prompts[i]):5d}  vllm {tuple(live[i])}  sim {sim[i]}")
    for name, k in (("GPU", 0), ("CPU", 1), ("STORAGE", 2)):
        print(f"{name}: vllm {sum(r[k] for r in live)} sim {sum(r[k] for r in sim)}")
    print("totals differ in", sum(1 for a, b in zip(live, sim, strict=True) if sum(a) != sum(b)))


if __name__ == "__main__":
    main()
