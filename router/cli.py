"""``kvroute`` command line: ``serve`` runs the router; other subcommands dispatch lazily.

``engine`` -> sim.server:main, ``fleet`` -> sim.fleet:main, ``sim`` -> sim.des_cli:main,
``load`` -> loadtest.chat_client:main, ``bench`` -> loadtest.bench:main, ``demo`` ->
loadtest.demo:main; each gets the remaining argv.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

from router.config import ConfigError, RouterConfig, load_config

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("sim.server", "run one simulated vLLM engine"),
    "fleet": ("sim.fleet", "start N simulated engines and write a fleet file"),
    "sim": ("sim.des_cli", "discrete-event simulation of a fleet behind a policy"),
    "load": ("loadtest.chat_client", "multi-turn streaming chat load against a router or engine URL"),
    "bench": ("loadtest.bench", "side-by-side benchmark runs and report"),
    "demo": ("loadtest.demo", "the end-to-end demo"),
}


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute serve", description="Run the kvroute router.")
    parser.add_argument("--config", help="TOML config file (env KVROUTE_CONFIG)")
    parser.add_argument("--fleet", help="fleet file (JSON written by `kvroute fleet`); its engines are added")
    parser.add_argument("--policy", help="policy name, e.g. round_robin, least_loaded, session_affinity")
    parser.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="policy parameter (repeatable), value parsed as JSON, e.g. epsilon=0.5",
    )
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="ID=URL",
        help="an engine (repeatable), e.g. e0=http://127.0.0.1:8001",
    )
    parser.add_argument(
        "--tokenizer",
        choices=("none", "sim", "hf", "engine"),
        help="how prompts become tokens for cache-aware policies: hf (with --tokenizer-path), engine "
        "(the engines' POST /tokenize), sim (simulated engines), none",
    )
    parser.add_argument("--tokenizer-path", help='backend "hf": the model\'s tokenizer directory')
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8000)")
    parser.add_argument("--log-level", help="critical, error, warning, info or debug")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="router processes sharing the port (SO_REUSEPORT; default 1); each keeps its own index "
        "from the same events and its own in-flight load view",
    )
    return parser


#: Benchmarks only (loadtest/bench_faults.py --soak-tracemalloc): a file; SIGUSR1 dumps a snapshot of
#: the router's Python allocations there (tracemalloc, started at once when this is set).
TRACEMALLOC_ENV = "_KVROUTE_TRACEMALLOC_FILE"
SIBLING_ENV = "_KVROUTE_SIBLING_WORKER"  # the sibling's worker index (1..N-1)
#: File descriptor of the workers' shared load board (router/worker_ledger.py), from the first worker.
BOARD_ENV = "_KVROUTE_WORKER_BOARD"


def _start_sibling_worker(argv: Sequence[str], index: int, board_fd: int | None = None) -> Any:
    """One more `kvroute serve` process with the same flags, as worker ``index`` of this one."""
    import os
    import subprocess

    # Not a KVROUTE_* name: the config layer rejects unknown ones.
    return subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", *argv, "--workers", "1"],
        env={**os.environ, SIBLING_ENV: str(index), **({BOARD_ENV: str(board_fd)} if board_fd else {})},
        pass_fds=(board_fd,) if board_fd else (),
        preexec_fn=_die_with_parent,
    )


class SiblingSupervisor:
    """The first worker's watch over the others: a sibling that dies (SIGKILL, OOM killer, crash)
    is started again in its slot (its row of the load board is void meanwhile), after
    ``restart_delay_s``, doubled up to ``MAX_RESTART_DELAY_S`` while restarts die within
    ``STABLE_S``. If the first worker itself dies the siblings follow it (``_die_with_parent``): the
    whole service exits and the process supervisor (systemd, Kubernetes) restarts it."""

    POLL_S = 0.5
    STABLE_S = 10.0
    MAX_RESTART_DELAY_S = 30.0

    def __init__(
        self, argv: Sequence[str], count: int, board_fd: int | None, restart_delay_s: float = 0.5
    ) -> None:
        import threading
        import time

        self._argv, self._board_fd = list(argv), board_fd
        self._first_delay_s = restart_delay_s
        self.children = [_start_sibling_worker(argv, i + 1, board_fd) for i in range(count)]
        self._started_s = [time.monotonic()] * count
        self._delay_s = [restart_delay_s] * count
        self._restart_at_s: list[float | None] = [None] * count
        self.restarts = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvroute-sibling-supervisor", daemon=True)
        if count:
            self._thread.start()

    def _watch(self) -> None:
        import time

        log = logging.getLogger("kvroute.workers")
        while not self._stopping.wait(self.POLL_S):
            now_s = time.monotonic()
            for i, child in enumerate(self.children):
                if child.poll() is None:
                    continue
                restart_at_s = self._restart_at_s[i]
                if restart_at_s is None:
                    lived_s = now_s - self._started_s[i]
                    delay_s = self._delay_s[i] if lived_s < self.STABLE_S else self._first_delay_s
                    self._restart_at_s[i] = now_s + delay_s
                    self._delay_s[i] = min(self.MAX_RESTART_DELAY_S, delay_s * 2)
                    log.error(
                        "worker %d (pid %d) exited with %s after %.0f s; restarting it in %.1f s",
                        i + 1,
                        child.pid,
                        child.returncode,
                        lived_s,
                        delay_s,
                    )
                elif now_s >= restart_at_s and not self._stopping.is_set():
                    self.children[i] = _start_sibling_worker(self._argv, i + 1, self._board_fd)
                    self._started_s[i], self._restart_at_s[i] = now_s, None
                    self.restarts += 1

    def stop(self) -> None:
        """Stop watching, then SIGTERM every sibling and wait for it."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        for child in self.children:
            child.terminate()
        for child in self.children:
            child.wait(10)


def _die_with_parent() -> None:
    """In a sibling, before exec: SIGTERM when the first worker exits, however it exits (uvicorn
    re-raises the stop signal after its shutdown, so the first worker's own cleanup may not run)."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def config_loader(args: argparse.Namespace, config_path: str | None) -> Callable[[], RouterConfig]:
    """Loads the config from every layer ``kvroute serve`` was started with - file, environment,
    these command-line flags, the fleet file - so /admin/reload and SIGHUP re-read the file
    without dropping what the command line added (engines, policy)."""
    import os

    def load() -> RouterConfig:
        return load_config(
            config_path,
            overrides=flag_overrides(args),
            fleet_file=args.fleet or os.environ.get("KVROUTE_FLEET"),
        )

    return load


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """CLI flags as a config dict in the file's shape (the highest-precedence layer)."""
    import json

    out: dict[str, Any] = {}
    if args.policy:
        out.setdefault("policy", {})["name"] = args.policy
    for item in args.policy_param:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--policy-param {item!r} must be KEY=VALUE (VALUE as JSON)")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        out.setdefault("policy", {}).setdefault("params", {})[key] = parsed
    if args.engine:
        engines = []
        for item in args.engine:
            engine_id, sep, url = item.partition("=")
            if not sep:
                raise ConfigError(f"--engine {item!r} must be ID=URL, e.g. e0=http://127.0.0.1:8001")
            engines.append({"id": engine_id, "url": url})
        out["engines"] = engines
    if args.tokenizer:
        out.setdefault("tokenizer", {})["backend"] = args.tokenizer
    if args.tokenizer_path:
        out.setdefault("tokenizer", {})["path"] = args.tokenizer_path
    if args.host:
        out.setdefault("listen", {})["host"] = args.host
    if args.port is not None:
        out.setdefault("listen", {})["port"] = args.port
    if args.log_level:
        out["log_level"] = args.log_level
    return out


def listen_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A bound TCP socket for ``host:port`` (as uvicorn binds it); raises OSError when taken.
    ``reuse_port``: other processes may bind it too (the kernel spreads connections: --workers).

    Binding before the server starts means a busy port fails before any startup work or message."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_server(
    app: Any,
    *,
    prog: str,
    host: str,
    port: int,
    on_started: Callable[[str], None],
    reuse_port: bool = False,
    on_bound: Callable[[], Callable[[], None]] | None = None,
    **uvicorn_options: Any,
) -> int:
    """Bind ``host:port`` first (a clear one-line error and exit 2 when taken), then serve ``app``
    with uvicorn; ``on_started(url)`` runs once the app's startup finished and requests are taken.
    ``on_bound()`` runs right after the bind and returns a cleanup run when the server stops."""
    import uvicorn
    from uvicorn.server import STARTUP_FAILURE

    from router.listener import AcceptingServer

    try:
        sock = listen_socket(host, port, reuse_port=reuse_port)
    except OSError as exc:
        print(
            f"{prog}: cannot listen on {host}:{port}: {exc.strerror or exc}; another process holds the "
            "port or the address is not on this machine (choose another with --port)",
            file=sys.stderr,
        )
        return 2
    url_host = f"[{host}]" if ":" in host else host
    url = f"http://{url_host}:{sock.getsockname()[1]}"

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            # uvicorn's startup for given sockets, served by router/listener.py's AcceptingServer
            # (every pending connection accepted at once) instead of the loop's create_server
            # (uvloop's takes one connection per turn of the loop).
            await self.lifespan.startup()
            if self.lifespan.should_exit:
                sys.exit(STARTUP_FAILURE)
            config = self.config
            state = self.server_state

            def create_protocol() -> asyncio.Protocol:
                return config.http_protocol_class(  # type: ignore[call-arg]
                    config=config, server_state=state, app_state=self.lifespan.state
                )

            loop = asyncio.get_running_loop()
            # uvicorn only calls close() and wait_closed() on what it keeps here.
            self.servers = [
                AcceptingServer(loop, create_protocol, s, config.backlog)  # type: ignore[misc]
                for s in sockets or []
            ]
            self.started = True
            if not self.should_exit:
                on_started(url)

    server = _Server(uvicorn.Config(app, host=host, port=port, **uvicorn_options))
    cleanup = on_bound() if on_bound is not None else None
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn shut down gracefully, then re-raised the captured Ctrl-C (as uvicorn.run does,
        # it is the expected way out, not an error).
        pass
    finally:
        sock.close()
        if cleanup is not None:
            cleanup()
    return 0 if server.started else 1


def _install_allocation_report(path: str) -> None:
    """Trace Python allocations; on SIGUSR1 dump a tracemalloc snapshot to ``path`` (replaced
    whole; the reader groups it by source line, ``tracemalloc.Snapshot.load``). Only the dump runs
    in the router: grouping a large heap would stall its event loop for seconds."""
    import os
    import signal
    import tracemalloc

    tracemalloc.start(1)

    def dump(signum: int, frame: Any) -> None:
        tmp = path + ".tmp"
        tracemalloc.take_snapshot().dump(tmp)
        os.replace(tmp, path)

    signal.signal(signal.SIGUSR1, dump)


def serve(argv: Sequence[str]) -> int:
    import os

    if os.environ.get(TRACEMALLOC_ENV):
        _install_allocation_report(os.environ[TRACEMALLOC_ENV])

    from router.service import build_router_app

    args = serve_parser().parse_args(list(argv))
    config_path = args.config or os.environ.get("KVROUTE_CONFIG")
    reload_config = config_loader(args, config_path)
    try:
        config = reload_config()
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    level = config.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    workers = args.workers if args.workers is not None else 1
    if workers < 1:
        print(f"kvroute serve: --workers must be >= 1, got {workers}", file=sys.stderr)
        return 2
    sibling = bool(os.environ.get(SIBLING_ENV))
    board: tuple[int, int] | None = None
    board_fd: int | None = None
    if sibling and os.environ.get(BOARD_ENV):
        board = (int(os.environ[BOARD_ENV]), int(os.environ[SIBLING_ENV]))
    elif workers > 1 and not config.shared.redis_url:
        # The workers share their load through a small memory-mapped board (with Redis, through
        # Redis like replicas); the siblings inherit its file descriptor.
        from router.worker_ledger import create_board

        board_fd = create_board(workers, [e.id for e in config.engines])
        board = (board_fd, 0)
    try:
        # SIGHUP re-reads the config file (like POST /admin/reload).
        app = build_router_app(
            config, config_path, install_sighup=True, reload_config=reload_config, worker_board=board
        )
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    from router.guard import guarded_http_protocol

    arms = config.experiment.arms
    policy = (
        "experiment " + ", ".join(f"{a.name}={a.policy}" for a in arms)
        if arms
        else f"policy {config.policy.name}"
    )

    def started(url: str) -> None:
        if sibling:  # the first worker speaks for all
            return
        print(
            f"kvroute serve: listening on {url} (OpenAI base_url {url}/v1); {policy}, "
            f"{len(config.engines)} engines, tokenizer {config.tokenizer.backend}, {workers} worker(s); "
            "Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )

    def start_siblings() -> Callable[[], None]:
        # Multi-worker: every process binds the same port with SO_REUSEPORT and runs the whole
        # router (event subscribers, index, scraping); the first one starts the others, restarts
        # any that dies and stops them on exit.
        if sibling:
            return lambda: None
        return SiblingSupervisor(argv, workers - 1, board_fd).stop

    multi = workers > 1 or sibling
    return run_server(
        app,
        prog="kvroute serve",
        host=config.listen.host,
        port=config.listen.port,
        on_started=started,
        reuse_port=multi,
        on_bound=start_siblings if multi else None,
        loop=loop,
        # httptools with header timeouts, header limits and a connection cap (router/guard.py).
        http=guarded_http_protocol(config.limits),
        log_level=config.log_level.lower(),
        access_log=False,
        timeout_keep_alive=30,
        # The guard takes the client address from X-Forwarded-For only for auth.trusted_proxies;
        # uvicorn's own rewrite would trust any 127.0.0.1 peer.
        proxy_headers=False,
        # SIGTERM: in-flight requests get limits.drain_timeout_s to finish, then they are cut.
        timeout_graceful_shutdown=config.limits.drain_timeout_s or None,
    )


#: Packages that only an extra installs -> the extra (for the message when one is missing).
_EXTRAS = {
    "matplotlib": "plots",
    "numpy": "plots",
    "tokenizers": "tokenizers",
    "jinja2": "tokenizers",
    "locust": "load",
    "redis": "scale",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        # Ctrl-C before a server took over its signals (imports, startup): no traceback.
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top in ("router", "sim", "loadtest", "policies", "kvcore") or not top:
            raise
        extra = _EXTRAS.get(top)
        hint = f"pip install 'kvroute[{extra}]'" if extra else f"pip install {top}"
        print(
            f"kvroute: this command needs the Python package {top!r}, which is not installed ({hint})",
            file=sys.stderr,
        )
        return 2


def _dispatch(args: list[str]) -> int:
    commands = ", ".join(["serve", *SUBCOMMANDS])
    if not args or args[0] in ("-h", "--help"):
        print(f"usage: kvroute {{{commands}}} [options]\n\n  serve    run the router")
        for name, (_, help_text) in SUBCOMMANDS.items():
            print(f"  {name:<8} {help_text}")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        return serve(rest)
    if command not in SUBCOMMANDS:
        print(f"kvroute: unknown command {command!r}; accepted: {commands}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
