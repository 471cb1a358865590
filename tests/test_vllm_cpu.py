"""The real-vLLM fleet's parts that need no engine (sim/vllm_cpu.py, sim/vllm_model.py): what its
profile and the CLI refuse, the engines' command line and environment, and the model folder."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from router.tokenize import HfChatTokenizer
from sim.vllm_cpu import VllmCpuFleet, VllmCpuProfile, engine_env
from sim.vllm_model import MODEL_NAME, write_model_dir

REPO = Path(__file__).resolve().parents[1]


def test_the_profile_refuses_what_vllm_cpu_cannot_run() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        VllmCpuProfile(block_size=16).check()
    with pytest.raises(ValueError, match="cannot hold one request"):
        VllmCpuProfile(gpu_blocks=128, max_model_len=4096).check()  # vLLM keeps one block back
    VllmCpuProfile(gpu_blocks=129, max_model_len=4096).check()
    with pytest.raises(ValueError, match="scheduling policy"):
        VllmCpuProfile(scheduling_policy="lifo").check()
    with pytest.raises(ValueError, match="cpu blocks -1"):
        VllmCpuProfile(cpu_blocks=-1).check()
    with pytest.raises(ValueError, match="sets --kv-transfer-config itself"):
        VllmCpuProfile(cpu_blocks=8, extra_args=("--kv-transfer-config", "{}")).check()


def test_a_cpu_tier_is_vllms_offloading_connector_with_the_host_copy_worker(tmp_path: Path) -> None:
    """``--cpu-blocks N`` on a vllm-cpu fleet: vLLM's OffloadingConnector loading the out-of-tree
    spec of sim/vllm_host_offload.py, sized in blocks, from a folder that holds that file alone
    (the engines' PYTHONPATH: nothing of the project leaks into vLLM's interpreter). Catches a
    spec name or module path the engines cannot import, and a plugin that imports the project."""
    import ast

    from sim.vllm_cpu import HOST_OFFLOAD_SCRIPT, profile_from_args, storage_pool_of

    fleet = VllmCpuFleet(tmp_path, model_dir=tmp_path / "model")
    fleet.python = Path("/venv/bin/python")
    argv = fleet.command(8000, 8100, 8200, VllmCpuProfile(cpu_blocks=600))
    connector = json.loads(dict(itertools.pairwise(argv))["--kv-transfer-config"])
    extra = connector["kv_connector_extra_config"]
    assert connector["kv_connector"] == "OffloadingConnector" and connector["kv_role"] == "kv_both"
    folder = fleet._plugin_dir()
    assert sorted(p.name for p in folder.iterdir()) == [f"{extra['spec_module_path']}.py"]
    tree = ast.parse((folder / HOST_OFFLOAD_SCRIPT.name).read_text())
    # The plugin runs in vLLM's interpreter (no project imports): its size key is read from its text.
    (key,) = (
        n.value.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and [getattr(t, "id", "") for t in n.targets] == ["CPU_BLOCKS_KEY"]
        and isinstance(n.value, ast.Constant)
    )
    assert extra[key] == 600 and extra["spec_name"] == "HostOffloadingSpec"
    assert any(isinstance(n, ast.ClassDef) and n.name == extra["spec_name"] for n in ast.walk(tree))
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots == {"__future__", "time", "typing", "torch", "vllm"}, roots
    assert "--kv-transfer-config" not in fleet.command(8000, 8100, 8200, VllmCpuProfile())
    # With a STORAGE folder: vLLM's tiering, its fs tier on that folder, publishing its events.
    argv = fleet.command(8000, 8100, 8200, VllmCpuProfile(cpu_blocks=600, storage_dir="/data/kv"))
    tiered = json.loads(dict(itertools.pairwise(argv))["--kv-transfer-config"])["kv_connector_extra_config"]
    assert tiered["spec_name"] == "HostTieringOffloadingSpec"
    assert any(isinstance(n, ast.ClassDef) and n.name == tiered["spec_name"] for n in ast.walk(tree))
    assert tiered["secondary_tiers"] == [{"type": "fs", "root_dir": "/data/kv", "enable_kv_events": True}]
    with pytest.raises(ValueError, match="sits behind a CPU tier"):
        VllmCpuProfile(storage_dir="/data/kv").check()
    assert storage_pool_of("/data/kv") == storage_pool_of("/data/kv/") != storage_pool_of("/data/kv2")
    assert storage_pool_of("") == ""

    class Args:
        cpu_blocks = 600
        storage_dir = "rel/kv"

    prof = profile_from_args(Args())
    assert prof.cpu_blocks == 600 and prof.storage_dir == os.path.realpath("rel/kv")


def test_fleet_cli_refuses_simulator_flags_with_the_vllm_backend() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "fleet", "--backend", "vllm-cpu",
         "--storage-blocks", "8", "--time-scale", "2"],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--storage-blocks, --time-scale: simulator-only" in proc.stderr


def test_engine_command_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = VllmCpuFleet(tmp_path, model_dir=tmp_path / "model")
    fleet.python = Path("/venv/bin/python")
    prof = VllmCpuProfile(scheduling_policy="priority", hash_algo="sha256_cbor", enable_scale_out=True)
    argv = fleet.command(8000, 8100, 8200, prof)
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(itertools.pairwise(argv))
    assert flags["--host"] == "127.0.0.1" and flags["--load-format"] == "dummy"
    assert flags["--block-size"] == "32" and flags["--num-gpu-blocks-override"] == "400"
    assert flags["--scheduling-policy"] == "priority" and flags["--prefix-caching-hash-algo"] == "sha256_cbor"
    assert "--enable-prompt-tokens-details" in argv and "--enable-scale-out" in argv
    kv = json.loads(flags["--kv-events-config"])
    assert kv["endpoint"] == "tcp://*:8100" and kv["replay_endpoint"] == "tcp://127.0.0.1:8200"
    monkeypatch.setenv("KVROUTE_POLICY_NAME", "tier_cost")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    env = engine_env(prof)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert "KVROUTE_POLICY_NAME" not in env and "PYTHONPATH" not in env


async def test_model_folder_is_deterministic_and_the_router_reads_it(tmp_path: Path) -> None:
    a = write_model_dir(tmp_path / "a")
    b = write_model_dir(tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    config = json.loads((a / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 2048
    hf = HfChatTokenizer.from_dir(a)
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the kv cache, éü 中文 🙂"},
    ]
    text = hf.render(msgs, add_generation_prompt=True)
    assert text.endswith("<|start|>assistant<|sep|>")
    tokens = await hf.chat_tokens(msgs)
    assert 10 < len(tokens) < len(text)  # merges learned; every byte encodable
    assert MODEL_NAME == "kvroute-tiny-llama"


FAKE_ENGINE = r'''#!{python}
"""Stands in for the venv's python: the first start dies as vLLM does when its port was taken;
the next one serves GET /health on its --port."""
import http.server, pathlib, sys
marker = pathlib.Path({marker!r})
if not marker.exists():
    marker.write_text("1")
    print("zmq.error.ZMQError: Address already in use (addr='tcp://*:5557')", flush=True)
    print("Traceback (most recent call last):\n" + "  File ...\n" * 2000, flush=True)  # as vLLM's, long
    sys.exit(1)
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


def test_an_engine_whose_port_was_taken_is_started_again_on_new_ports(tmp_path: Path) -> None:
    """On a busy machine another process can bind an engine's free port in the minutes before vLLM
    does; vLLM then exits with "Address already in use". The fleet starts that engine again on new
    ports instead of failing the whole fleet (a stand-in interpreter plays vLLM's two starts)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_ENGINE.format(python=sys.executable, marker=str(tmp_path / "first-start")))
    fake.chmod(0o755)
    logs: list[str] = []
    fleet = VllmCpuFleet(tmp_path / "fleet", model_dir=tmp_path, log=logs.append)
    fleet.python = fake
    try:
        (engine,) = fleet.start(1, VllmCpuProfile(startup_timeout_s=60))
        assert (tmp_path / "first-start").exists()  # the first start did die
        assert engine.process is not None and engine.process.poll() is None
        assert any("starting it again on new ports" in line for line in logs), logs
        starts = [line.rsplit(" on ", 1)[1].split()[0] for line in logs if " starting on " in line]
        assert len(starts) == 2 and starts[0] != starts[1]  # the second start got a new port
        assert engine.url == f"http://{starts[1]}"
    finally:
        fleet.stop(timeout_s=5)


def test_fleet_cli_flags_for_the_quality_bench_reach_the_engines() -> None:
    """--hash-algo, --enable-scale-out and --dev-mode (what the real-vLLM quality bench needs) land in
    the profile; dev mode is vLLM's environment switch for POST /reset_prefix_cache; the simulated
    backend refuses the vLLM-only two."""
    from sim.fleet import build_arg_parser
    from sim.fleet import profile_from_args as sim_profile
    from sim.vllm_cpu import profile_from_args

    parser = build_arg_parser()
    args = parser.parse_args(
        ["--backend", "vllm-cpu", "--hash-algo", "sha256_cbor", "--enable-scale-out", "--dev-mode"]
    )
    prof = profile_from_args(args)
    assert (prof.hash_algo, prof.enable_scale_out, prof.dev_mode) == ("sha256_cbor", True, True)
    assert engine_env(prof)["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_SERVER_DEV_MODE" not in engine_env(VllmCpuProfile())
    with pytest.raises(ValueError, match="--dev-mode is for --backend vllm-cpu"):
        sim_profile(parser.parse_args(["--dev-mode"]))


def test_the_engines_temp_files_live_in_a_folder_the_fleet_removes(tmp_path: Path) -> None:
    """vLLM leaves its ZMQ IPC sockets and ``vllm_dist_*`` files in the temp folder (seen: dozens
    per test session in /tmp). The fleet gives its engines their own TMPDIR and removes it on stop,
    while torch's compile cache stays shared. A child that writes where ``tempfile`` points stands in
    for vLLM here (tests/vllm/ checks vLLM itself). Catches an engine environment without TMPDIR
    (the file lands in the system's temp folder) and a stop that leaves the folder."""
    fleet = VllmCpuFleet(tmp_path, model_dir=tmp_path / "model")
    writes = (
        "import os, tempfile, time; "
        "print(os.environ['TORCHINDUCTOR_CACHE_DIR'], flush=True); "
        "open(os.path.join(tempfile.gettempdir(), 'vllm_dist_probe'), 'w').close(); time.sleep(60)"
    )  # the print comes first: once the probe exists, the log holds the line (a stop may follow at once)
    fleet.command = lambda *_args: [sys.executable, "-c", writes]  # type: ignore[method-assign]
    try:
        fleet.engines.append(fleet._spawn("v0", VllmCpuProfile(), 0))
        tmp = fleet.engine_tmp
        assert tmp is not None and not tmp.is_relative_to(tmp_path)  # short: socket paths <= 107 bytes
        deadline = time.monotonic() + 30
        while not (tmp / "vllm_dist_probe").exists():
            assert time.monotonic() < deadline, "the child never wrote into the fleet's TMPDIR"
            assert fleet.engines[0].process.poll() is None, (tmp_path / "v0.log").read_text()
            time.sleep(0.05)
    finally:
        fleet.stop(timeout_s=5)
    assert not tmp.exists() and fleet.engine_tmp is None
    cache = (tmp_path / "v0.log").read_text().strip()
    assert Path(cache).parent == Path(tempfile.gettempdir()) and Path(cache).name.startswith("torchinductor_")
