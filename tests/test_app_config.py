"""Config layering (flags > env > file > defaults), validation messages, fleet files, CLI dispatch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.cli import flag_overrides, main, serve_parser
from router.config import ConfigError, EngineConfig, load_config, load_fleet_file, write_fleet_file

REPO = Path(__file__).resolve().parents[1]

TOML = """
log_level = "warning"
[listen]
port = 9001
[policy]
name = "session_affinity"
params = { epsilon = 0.5 }
[limits]
max_body_bytes = 1000
[[engines]]
id = "a"
url = "http://127.0.0.1:8101"
model = "m"
kv_events_endpoint = "tcp://127.0.0.1:5557"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "router.toml"
    path.write_text(text)
    return path


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, TOML)
    config = load_config(path, environ={})
    assert config.listen.port == 9001 and config.listen.host == "127.0.0.1"  # file, default
    assert config.policy.params == {"epsilon": 0.5}
    assert config.engines[0].kv_events_endpoint == "tcp://127.0.0.1:5557"
    env = {
        "KVROUTE_LISTEN_PORT": "9002",
        "KVROUTE_LIMITS_MAX_BODY_BYTES": "2000",
        "KVROUTE_POLICY_NAME": "least_loaded",
        "KVROUTE_POLICY_PARAMS": "{}",
        "PATH": "/bin",
    }
    config = load_config(path, environ=env)
    assert (config.listen.port, config.limits.max_body_bytes, config.policy.name) == (
        9002,
        2000,
        "least_loaded",
    )
    args = serve_parser().parse_args(
        ["--port", "9003", "--policy", "power_of_two", "--policy-param", "seed=4"]
    )
    config = load_config(path, environ=env, overrides=flag_overrides(args))
    assert (config.listen.port, config.limits.max_body_bytes) == (9003, 2000)
    assert (config.policy.name, config.policy.params) == ("power_of_two", {"seed": 4})


def test_engines_from_env_and_flags() -> None:
    config = load_config(environ={"KVROUTE_ENGINES": "x=http://127.0.0.1:1, y=http://127.0.0.1:2"})
    assert [(e.id, e.url) for e in config.engines] == [
        ("x", "http://127.0.0.1:1"),
        ("y", "http://127.0.0.1:2"),
    ]
    args = serve_parser().parse_args(["--engine", "z=http://127.0.0.1:3"])
    config = load_config(environ={}, overrides=flag_overrides(args))
    assert [e.id for e in config.engines] == ["z"]


@pytest.mark.parametrize(
    "text, environ, needle",
    [
        (TOML.replace("port = 9001", 'port = "high"'), {}, "listen.port"),
        (TOML.replace("port = 9001", "prot = 9001"), {}, "accepted keys here: host, port"),
        (TOML.replace('name = "session_affinity"', 'name = "nope"'), {}, "unknown policy 'nope'; accepted:"),
        (TOML.replace("epsilon = 0.5", "epsilon = -1"), {}, "epsilon must be >= 0"),
        (TOML.replace('url = "http://127.0.0.1:8101"', 'url = "127.0.0.1:8101"'), {}, "engines[0].url"),
        (TOML, {"KVROUTE_LISTEN_PROT": "1"}, "unknown environment variable KVROUTE_LISTEN_PROT"),
        (TOML + '[[engines]]\nid = "a"\nurl = "http://h:1"\n', {}, "engines[1].id 'a' is used twice"),
        (
            TOML.replace('log_level = "warning"', 'log_level = "loud"'),
            {},
            "log_level 'loud' unknown; accepted",
        ),
        (
            TOML,
            {"KVROUTE_PROXY_CALLBACK_PATH": "sometimes"},
            'callback_path`; accepted: true, false, "idle" or an integer >= 1',
        ),
        (
            TOML,
            {"KVROUTE_PROXY_CALLBACK_PATH": "0"},
            'proxy.callback_path must not be 0; accepted: true, false, "idle" or an integer >= 1',
        ),
        (
            TOML,
            {"KVROUTE_COSTS_STORAGE_POOL_BANDWIDTH": '{"nas": 1e9}'},
            "costs.storage_pool_bandwidth names pool 'nas', which no engine mounts",
        ),
        (
            TOML.replace(
                'url = "http://127.0.0.1:8101"', 'url = "http://127.0.0.1:8101"\nstorage_pool = "nas"'
            ),
            {"KVROUTE_COSTS_STORAGE_POOL_BANDWIDTH": '{"nas": 0}'},
            "costs.storage_pool_bandwidth.nas must be a positive number of bytes/s",
        ),
        ("[listen]\nport = 1\n", {}, "no engines configured"),
        ("[listen\n", {}, "not valid TOML"),
    ],
)
def test_invalid_config_names_the_key(
    tmp_path: Path, text: str, environ: dict[str, str], needle: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), environ=environ)
    assert needle in str(info.value)


def test_fleet_file_round_trip_and_merge(tmp_path: Path) -> None:
    engines = [
        EngineConfig(
            id=f"sim-{i}",
            url=f"http://127.0.0.1:{8200 + i}",
            model="kvroute-sim",
            kv_events_endpoint=f"tcp://127.0.0.1:{5600 + i}",
            storage_pool="pool-0",
        )
        for i in range(2)
    ]
    fleet = tmp_path / "fleet.json"
    write_fleet_file(fleet, engines)
    assert load_fleet_file(fleet) == engines
    config = load_config(write(tmp_path, TOML), environ={}, fleet_file=fleet)
    assert [e.id for e in config.engines] == ["a", "sim-0", "sim-1"]
    fleet.write_text('{"version": 1, "engines": [{"id": "x", "url": "http://h:1", "colour": 1}]}')
    with pytest.raises(ConfigError, match="accepted engine keys: id, url, model"):
        load_fleet_file(fleet)
    fleet.write_text('{"version": 9, "engines": []}')
    with pytest.raises(ConfigError, match="version 9"):
        load_fleet_file(fleet)


def test_cli_help_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    assert "accepted: serve, engine" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_serve_rejects_bad_config_before_starting(tmp_path: Path) -> None:
    bad = write(tmp_path, TOML.replace("port = 9001", "port = 99999"))
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "listen.port must be 0..65535" in proc.stderr


def test_reload_keeps_the_command_line_layer(tmp_path, monkeypatch) -> None:
    """`kvroute serve --config f --engine e0=... --policy tier_cost`: the file has no engines, so
    re-reading the file alone fails; the serve loader re-applies the flags."""
    from router.cli import config_loader, serve_parser
    from router.errors import RouterError
    from router.service import build_router_app

    monkeypatch.delenv("KVROUTE_FLEET", raising=False)
    path = tmp_path / "router.toml"
    path.write_text('[tokenizer]\nbackend = "sim"\n')
    args = serve_parser().parse_args(
        ["--config", str(path), "--engine", "e0=http://127.0.0.1:9", "--policy", "tier_cost"]
    )
    loader = config_loader(args, str(path))
    config = loader()
    path.write_text(
        '[tokenizer]\nbackend = "sim"\n[experiment]\narms = [{name = "a", policy = "tier_cost"},'
        ' {name = "b", policy = "round_robin"}]\n'
    )
    with_flags = build_router_app(config, str(path), reload_config=loader).state.services
    assert with_flags.reload()["arms"] == ["a", "b"]
    assert [e.id for e in loader().engines] == ["e0"]
    file_only = build_router_app(config, str(path)).state.services
    with pytest.raises(RouterError, match="engine"):
        file_only.reload()


@pytest.mark.parametrize("policy", ["approx_prefix", "kv_gpu", "tier_cost"])
def test_policy_needing_block_keys_without_a_tokenizer_is_a_config_error(policy: str) -> None:
    """Without keys such a policy would quietly route by load alone."""
    from router.service import build_router_app

    overrides = {
        "engines": [{"id": "e0", "url": "http://127.0.0.1:9"}],
        "policy": {"name": policy},
        "tokenizer": {"backend": "none"},
    }
    # Refused when the config is validated (before anything starts); build_router_app refuses too.
    with pytest.raises(ConfigError, match=f"{policy}.*tokenizer.backend"):
        build_router_app(load_config(environ={}, overrides=overrides))
