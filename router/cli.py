"""``kvroute`` command line: ``serve`` runs the router; other subcommands dispatch lazily.

``engine`` -> sim.server:main, ``fleet`` -> sim.fleet:main, ``sim`` -> sim.des:main,
``bench`` -> loadtest.bench:main, ``demo`` -> loadtest.demo:main; each gets the remaining argv.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from router.config import ConfigError, RouterConfig, load_config

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("sim.server", "run one simulated vLLM engine"),
    "fleet": ("sim.fleet", "start N simulated engines and write a fleet file"),
    "sim": ("sim.des", "discrete-event simulation of a fleet behind a policy"),
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


SIBLING_ENV = "_KVROUTE_SIBLING_WORKER"


def _reuse_port_socket(host: str, port: int) -> Any:
    """A listening TCP socket that other processes may bind too (the kernel spreads connections)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _start_sibling_workers(argv: Sequence[str], count: int) -> list[Any]:
    """``count`` more `kvroute serve` processes with the same flags, as workers of this one."""
    import os
    import subprocess

    # Not a KVROUTE_* name: the config layer rejects unknown ones.
    env = {**os.environ, SIBLING_ENV: "1"}
    return [
        subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", *argv, "--workers", "1"],
            env=env,
            preexec_fn=_die_with_parent,
        )
        for _ in range(count)
    ]


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
    if args.host:
        out.setdefault("listen", {})["host"] = args.host
    if args.port is not None:
        out.setdefault("listen", {})["port"] = args.port
    if args.log_level:
        out["log_level"] = args.log_level
    return out


def serve(argv: Sequence[str]) -> int:
    import os

    import uvicorn

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
    try:
        # SIGHUP re-reads the config file (like POST /admin/reload).
        app = build_router_app(config, config_path, install_sighup=True, reload_config=reload_config)
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    from router.guard import guarded_http_protocol

    workers = args.workers if args.workers is not None else 1
    if workers < 1:
        print(f"kvroute serve: --workers must be >= 1, got {workers}", file=sys.stderr)
        return 2
    uv_config = uvicorn.Config(
        app,
        host=config.listen.host,
        port=config.listen.port,
        loop=loop,
        # httptools with header timeouts, header limits and a connection cap (router/guard.py).
        http=guarded_http_protocol(config.limits),
        log_level=config.log_level.lower(),
        access_log=False,
        timeout_keep_alive=30,
    )
    if workers == 1 and not os.environ.get(SIBLING_ENV):
        uvicorn.Server(uv_config).run()
        return 0
    # Multi-worker: every process binds the same port with SO_REUSEPORT and runs the whole router
    # (event subscribers, index, scraping); the first one starts the others and stops them on exit.
    sock = _reuse_port_socket(config.listen.host, config.listen.port)
    siblings = [] if os.environ.get(SIBLING_ENV) else _start_sibling_workers(argv, workers - 1)
    try:
        uvicorn.Server(uv_config).run(sockets=[sock])
    finally:
        for child in siblings:
            child.terminate()
        for child in siblings:
            child.wait(10)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
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
    module_name = SUBCOMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(
                f"kvroute {command}: module {module_name} is not available in this install ({exc})",
                file=sys.stderr,
            )
            return 2
        raise
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
