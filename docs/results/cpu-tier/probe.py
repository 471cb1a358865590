"""What vLLM's CPU build does with a CPU tier and a STORAGE pool (docs/results/cpu-tier.md).

    python docs/results/cpu-tier/probe.py            # all three parts, ~4 minutes
    python docs/results/cpu-tier/probe.py refused    # one part: refused | cpu | storage

refused: vLLM's own three ways to a CPU tier, each on one engine: does it start?
cpu:     one engine of 400 GPU blocks with the host-copy CPU tier (sim/vllm_host_offload.py) of
         300 or 2,000 blocks: prompt A (7,066 tokens), five other prompts of its size, A again.
storage: two engines of 400 GPU blocks, 300-block CPU tiers, vLLM's fs tier on one folder: A on
         v0, five others on v0, A on v0 again, A on v1 (which never saw it).
Each prints the cached tokens vLLM reported, the KV events by kind and medium (read with kvroute's
own decoder) and vLLM's offload counters. Engines in eager mode, on loopback, stopped at the end.
"""

from __future__ import annotations

import collections
import json
import re
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import zmq

from kvcore.wire import decode_payload
from sim.vllm_cpu import VllmCpuFleet, VllmCpuProfile

BASE = VllmCpuProfile(enforce_eager=True, startup_timeout_s=900)
GIB = 1 << 30
REFUSED = {
    "--kv-offloading-size 1 --kv-offloading-backend native": (
        "--kv-offloading-size", "1", "--kv-offloading-backend", "native"),
    "OffloadingConnector, TieringOffloadingSpec": ("--kv-transfer-config", json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": GIB}})),
    "SimpleCPUOffloadConnector": ("--kv-transfer-config", json.dumps({
        "kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": GIB}})),
}  # fmt: skip
OFFLOAD_COUNTERS = re.compile(r"^vllm:kv_offload_(load|store)_(bytes|time)_total\{[^}]*\} (\S+)$", re.M)


def refused(workdir: Path) -> None:
    for name, extra in REFUSED.items():
        fleet = VllmCpuFleet(workdir / f"refused-{len(name)}", log=lambda _s: None)
        try:
            fleet.start(1, replace(BASE, extra_args=extra))
            print(f"- {name}: started")
        except Exception:
            log = (fleet.workdir / "v0.log").read_text(errors="replace")
            why = re.findall(r"Worker failed with error '(.*?)', please check", log) or [
                "(see the engine log)"
            ]
            print(f"- {name}: refused: {why[-1]}")
        finally:
            fleet.stop()


class Events:
    """KV events per (engine, kind, medium), in blocks, from every engine's PUB socket."""

    def __init__(self, engines: list[Any]) -> None:
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._ctx = zmq.Context()
        self._subs = []
        for e in engines:
            sub = self._ctx.socket(zmq.SUB)
            sub.connect(e.kv_events_endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._subs.append((e.id, sub))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for _, sub in self._subs:
            poller.register(sub, zmq.POLLIN)
        names = {id(sub): eid for eid, sub in self._subs}
        while not self._stop.is_set():
            for sub, _ in poller.poll(200):
                for ev in decode_payload(sub.recv_multipart()[-1]).events:
                    blocks = len(getattr(ev, "block_hashes", None) or [None])
                    self.counts[(names[id(sub)], type(ev).__name__, str(getattr(ev, "medium", "")))] += blocks

    def close(self) -> None:
        time.sleep(1.0)
        self._stop.set()
        self._thread.join()
        for _, sub in self._subs:
            sub.close()
        self._ctx.term()


def ask(engine: Any, k: int) -> tuple[int, int]:
    prompt = " ".join(f"w{k}x{i}" for i in range(1500))
    r = httpx.post(
        f"{engine.url}/v1/completions",
        json={"model": engine.model, "prompt": prompt, "max_tokens": 2},
        timeout=300,
    )
    r.raise_for_status()
    usage = r.json()["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def scenario(workdir: Path, name: str, n: int, prof: VllmCpuProfile) -> None:
    fleet = VllmCpuFleet(workdir / name, log=lambda _s: None)
    try:
        fleet.start(n, prof)
        events = Events(fleet.engines)
        time.sleep(1.0)
        v0 = fleet.engines[0]
        print(f"\n{name}: {n} engine(s), {prof.gpu_blocks} GPU blocks, CPU tier {prof.cpu_blocks} blocks"
              + (", fs STORAGE pool" if prof.storage_dir else ""))  # fmt: skip
        prompt, cached = ask(v0, 0)
        print(f"- A on v0: prompt {prompt} tokens, cached {cached}")
        for k in range(1, 6):
            ask(v0, k)
        print(f"- A again on v0 after five others: cached {ask(v0, 0)[1]}")
        if n > 1:
            print(f"- A on v1, which never saw it: cached {ask(fleet.engines[1], 0)[1]}")
        events.close()
        for (eid, kind, medium), blocks in sorted(events.counts.items()):
            print(f"  events {eid} {kind} {medium}: {blocks} blocks")
        for e in fleet.engines:
            counters = {
                f"{d}_{u}": float(v)
                for d, u, v in OFFLOAD_COUNTERS.findall(httpx.get(e.url + "/metrics").text)
            }
            if counters.get("load_time"):
                rate = counters["load_bytes"] / counters["load_time"] / 1e9
                print(f"  {e.id} offload counters: {counters} -> loads at {rate:.2f} GB/s")
        if prof.storage_dir:
            print(
                f"  block files in the pool's folder: {sum(1 for _ in Path(prof.storage_dir).rglob('*.bin'))}"
            )
    finally:
        fleet.stop()


def main() -> None:
    parts = sys.argv[1:] or ["refused", "cpu", "storage"]
    with tempfile.TemporaryDirectory(prefix="kvroute-cpu-tier-") as tmp:
        workdir = Path(tmp)
        if "refused" in parts:
            refused(workdir)
        if "cpu" in parts:
            for blocks in (300, 2000):
                scenario(workdir, f"cpu-{blocks}", 1, replace(BASE, cpu_blocks=blocks))
        if "storage" in parts:
            (workdir / "pool").mkdir()
            scenario(workdir, "storage", 2, replace(BASE, cpu_blocks=300, storage_dir=str(workdir / "pool")))


if __name__ == "__main__":
    main()
