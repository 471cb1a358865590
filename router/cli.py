"""``kvroute`` command line: ``serve`` runs the router; other subcommands dispatch lazily.

``engine`` -> sim.server:main, ``fleet`` -> sim.fleet:main, ``sim`` -> sim.des:main,
``bench`` -> loadtest.bench:main, ``demo`` -> loadtest.demo:main; each gets the remaining argv.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from router.config import ConfigError, load_config

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
    return parser


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
    try:
        config = load_config(
            config_path,
            overrides=flag_overrides(args),
            fleet_file=args.fleet or os.environ.get("KVROUTE_FLEET"),
        )
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    level = config.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # SIGHUP re-reads the config file (like POST /admin/reload).
        def reload_config() -> Any:  # every layer again: file, env, these flags, the fleet file
            return load_config(
                config_path,
                overrides=flag_overrides(args),
                fleet_file=args.fleet or os.environ.get("KVROUTE_FLEET"),
            )

        app = build_router_app(config, config_path, install_sighup=True, reload_config=reload_config)
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    uvicorn.run(
        app,
        host=config.listen.host,
        port=config.listen.port,
        loop=loop,
        http="auto",
        log_level=config.log_level.lower(),
        access_log=False,
        timeout_keep_alive=30,
    )
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
