"""What a user sees from the command line when something is wrong: one clear line naming the key
and the accepted values, exit code 2, never a Python traceback. Run as real subprocesses (the
``kvroute`` entry point), as a user would; plus a clean Ctrl-C of a router with traffic behind it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
ENGINE = "e0=http://127.0.0.1:9"  # never contacted: these runs stop before serving


def kvroute(*args: str, timeout_s: float = 100.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def assert_clean_refusal(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def test_config_that_is_a_directory(tmp_path: Path) -> None:
    proc = kvroute("serve", "--config", str(tmp_path))
    assert_clean_refusal(proc, f"config file {tmp_path} is a directory")


def test_config_that_is_not_utf8(tmp_path: Path) -> None:
    bad = tmp_path / "router.toml"
    bad.write_bytes(b'log_level = "\xff\xfe"\n')
    proc = kvroute("serve", "--config", str(bad))
    assert_clean_refusal(proc, "is not UTF-8 text", "offset 13")


def test_bad_policy_parameter_lists_the_valid_ones() -> None:
    proc = kvroute(
        "serve", "--engine", ENGINE, "--tokenizer", "sim", "--policy", "tier_cost", "--policy-param", "wrok=1"
    )
    assert_clean_refusal(
        proc, "policy.params: policy 'tier_cost' has no parameter wrok", "work_weight (default 1.0)"
    )
    assert "__init__" not in proc.stderr  # no Python signature


@pytest.mark.parametrize("policy", ["tier_cost", "kv_gpu", "kv_fixed_credit", "approx_prefix"])
def test_blind_policy_is_refused_naming_key_and_values(policy: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            environ={}, overrides={"engines": [{"id": "a", "url": "http://h:1"}], "policy": {"name": policy}}
        )
    text = str(info.value)
    assert f'policy "{policy}" matches prompt blocks' in text
    assert 'tokenizer.backend = "none"' in text and '"hf" with path' in text and '"engine"' in text
    # A keyless policy is offered; the blind one is not.
    assert (
        "round_robin" in text.split("needs no tokens:")[1] and policy not in text.split("needs no tokens:")[1]
    )


def test_blind_experiment_arm_and_disabled_index_are_refused() -> None:
    base = {"engines": [{"id": "a", "url": "http://h:1"}]}
    arms = {"arms": [{"name": "c", "policy": "round_robin"}, {"name": "t", "policy": "tier_cost"}]}
    with pytest.raises(ConfigError, match=r'experiment.arms\[1\].policy "tier_cost" matches prompt blocks'):
        load_config(environ={}, overrides={**base, "experiment": arms})
    with pytest.raises(
        ConfigError, match=r'policy "kv_gpu" reads the prefix index, but index.enabled = false'
    ):
        load_config(
            environ={},
            overrides={
                **base,
                "policy": {"name": "kv_gpu"},
                "tokenizer": {"backend": "sim"},
                "index": {"enabled": False},
            },
        )
    # With a tokenizer the same configs load; keyless policies never needed one.
    ok = load_config(environ={}, overrides={**base, "experiment": arms, "tokenizer": {"backend": "sim"}})
    assert [a.policy for a in ok.experiment.arms] == ["round_robin", "tier_cost"]
    assert (
        load_config(environ={}, overrides={**base, "policy": {"name": "least_loaded"}}).tokenizer.backend
        == "none"
    )


def test_blind_quick_start_is_refused_from_the_command_line() -> None:
    proc = kvroute("serve", "--engine", ENGINE, "--policy", "tier_cost")
    assert_clean_refusal(proc, 'policy "tier_cost" matches prompt blocks', 'tokenizer.backend = "none"')


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_port_in_use_fails_before_startup() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = kvroute("serve", "--engine", ENGINE, "--port", str(port))
        engine = kvroute("engine", "--port", str(port))
    assert_clean_refusal(
        proc, f"kvroute serve: cannot listen on 127.0.0.1:{port}", "choose another with --port"
    )
    assert "Application startup complete" not in proc.stdout + proc.stderr
    assert_clean_refusal(engine, f"kvroute engine: cannot listen on 127.0.0.1:{port}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "router.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_line(proc: subprocess.Popen[str], needle: str) -> tuple[str, list[str]]:
    """Read the process's output until a line contains ``needle`` (EOF = it died: fail)."""
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return line, seen
    raise AssertionError(f"exited with {proc.wait()} before printing {needle!r}:\n{''.join(seen)}")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(400)  # an engine and a router start, serve and stop; slow on a busy machine
def test_engine_and_router_say_where_they_listen_and_stop_cleanly_on_ctrl_c(
    procs: list[subprocess.Popen[str]],
) -> None:
    engine_port, events_port, replay_port, router_port = (_free_port() for _ in range(4))
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv-events",
    }
    engine = _start(["engine", "--port", str(engine_port), "--kv-events-config", json.dumps(events)])
    procs.append(engine)
    line, engine_out = _wait_for_line(engine, "listening on")
    assert f"http://127.0.0.1:{engine_port}" in line and f"tcp://127.0.0.1:{events_port}" in line
    router = _start(
        ["serve", "--engine", f"e0=http://127.0.0.1:{engine_port}", "--port", str(router_port),
         "--tokenizer", "sim", "--policy", "tier_cost"]
    )  # fmt: skip
    procs.append(router)
    line, router_out = _wait_for_line(router, "listening on")
    assert (
        f"http://127.0.0.1:{router_port}/v1" in line
        and "policy tier_cost" in line
        and "tokenizer sim" in line
    )
    body = {"model": "kvroute-sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
    request = urllib.request.Request(
        f"http://127.0.0.1:{router_port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert json.loads(resp.read())["choices"][0]["message"]["content"]
    with urllib.request.urlopen(f"http://127.0.0.1:{router_port}/version", timeout=10) as resp:
        from router import __version__

        assert json.loads(resp.read()) == {"version": __version__}
    time.sleep(0.5)  # let the health poller, scrapers and event subscriber run with open sessions
    for proc, out in ((router, router_out), (engine, engine_out)):
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=100)
        text = "".join(out) + rest
        assert proc.returncode == 0, text
        assert "Traceback" not in text and "Unclosed" not in text and "ERROR" not in text, text


def test_missing_optional_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import router.cli as cli

    def dispatch(args: list[str]) -> int:
        raise ModuleNotFoundError("No module named 'tokenizers'", name="tokenizers")

    monkeypatch.setattr(cli, "_dispatch", dispatch)
    assert cli.main(["serve", "--tokenizer", "hf"]) == 2
    err = capsys.readouterr().err
    assert "needs the Python package 'tokenizers'" in err and "pip install 'kvroute[tokenizers]'" in err


def test_load_against_a_port_where_nothing_listens_fails_within_seconds() -> None:
    """Issue 28 item 5: a wrong router port is "connection refused" in a few seconds, not after the
    60 s start-up wait (66 s before)."""
    from sim.server import free_port

    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "load", "--url", f"http://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed_s = time.monotonic() - started
    assert proc.returncode == 1
    assert "connection refused: nothing listens" in proc.stderr
    assert elapsed_s < 20, f"took {elapsed_s:.0f} s"
