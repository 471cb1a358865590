"""Does vLLM 0.32 (its CPU build) abort a queued stream whose client closes its connection?

One engine of its own with --max-num-seqs 1 (sim/vllm_cpu.py; `make test-vllm` installs vLLM): a
stream A of 7,000 tokens runs, a stream B queues behind it, B's socket is closed; the engine's
(running, waiting) gauges are printed for 10 s, then A's socket is closed too. Run from the checkout:

    .venv/bin/python docs/results/q25/abort_check.py /tmp/abort-check
"""

import json
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from sim.vllm_cpu import VllmCpuFleet  # noqa: E402
from sim.vllm_model import MODEL_NAME  # noqa: E402
from tests.vllm.conftest import PROFILE  # noqa: E402


def post_stream(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
    sock.sendall(head.encode() + b"content-length: %d\r\n\r\n" % len(data) + data)
    return sock


def queue(url: str) -> tuple[float, float]:
    running = waiting = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            running += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:num_requests_waiting{"):
            waiting += float(line.rsplit(" ", 1)[1])
    return running, waiting


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    fleet = VllmCpuFleet(folder)
    try:
        profile = replace(PROFILE, enforce_eager=True, extra_args=("--max-num-seqs", "1"))
        (engine,) = fleet.start_each([profile], id_prefix="q")
        body = {"model": MODEL_NAME, "max_tokens": 7000, "ignore_eos": True, "stream": True}
        a = post_stream(engine.url, {**body, "prompt": "the cat sat on the mat " * 10})
        while queue(engine.url) != (1.0, 0.0):
            time.sleep(0.05)
        b = post_stream(engine.url, {**body, "prompt": "a dog ran in the park " * 10})
        while queue(engine.url) != (1.0, 1.0):
            time.sleep(0.05)
        print("A running, B queued; closing B's connection")
        b.close()
        closed = time.monotonic()
        while time.monotonic() - closed < 10.0:
            state = queue(engine.url)  # (the engine may take seconds to answer while it works)
            print(f"  +{time.monotonic() - closed:.2f} s: (running, waiting) = {state}")
            time.sleep(0.1)
        a.close()
    finally:
        fleet.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
