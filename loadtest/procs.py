"""Child processes of the load tools and benchmarks (routers, engines, upstream stand-ins): wait
until one answers over HTTP (or, for a router, until its KV-event sources are connected), stop one
with its whole process group. Children are started with
``start_new_session=True`` so that a stop reaches whatever they spawned (uvicorn workers).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable


def wait_http_ok(
    url: str,
    proc: subprocess.Popen[bytes] | None,
    timeout_s: float = 30.0,
    *,
    output: Callable[[], str] | None = None,
) -> None:
    """Wait until GET ``url`` answers 200; raise if ``proc`` exits first or the time runs out.
    ``output``: what the process wrote (e.g. its log's tail), added to the error."""

    def fail(what: str) -> RuntimeError:
        text = output() if output is not None else ""
        return RuntimeError(f"{what}{': ' + text[-2000:] if text else ''}")

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise fail(f"{proc.args!r} exited with code {proc.returncode} while starting")
        try:
            # No proxies: the children listen on loopback (urllib would honour http_proxy).
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise fail(f"{url} not ready after {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group (started with start_new_session), SIGKILL after ``timeout_s``."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_sources_connected(url: str, timeout_s: float = 60.0) -> None:
    """Until every KV-event source of the router at ``url`` is past connecting (its replay answered),
    so that no run starts with a blind index."""
    deadline = time.monotonic() + timeout_s
    while True:
        # No proxies, as above; urllib, not httpx: the load tools run without the test extras.
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"{url}/debug/index", timeout=10
        ) as resp:
            sources = json.load(resp)["events"]["sources"]
        if sources and all(s["status"] not in ("connecting", "starting") for s in sources.values()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the router's KV-event sources did not connect in {timeout_s:.0f} s: {sources}"
            )
        time.sleep(0.1)
