"""tools/pyspy_split.py: each sample of the chosen router process lands in the part its innermost
frame names (a write line, the loop, each protocol, kvroute's own code), start-up and other
processes left out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pyspy_split", REPO / "tools" / "pyspy_split.py")
assert _spec is not None and _spec.loader is not None
pyspy_split = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pyspy_split)

ROUTER = (
    'process 1:"python -m loadtest.bench_peers";process 7:"python -m router.cli serve --policy tier_cost"'
)
OTHER = 'process 1:"python -m loadtest.bench_peers";process 8:"python -m loadtest.bench_proxy _upstream 1"'


def test_samples_are_split_by_their_innermost_frame(tmp_path: Path) -> None:
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "proxy.py").write_text("a = 1\n        self.transport.write(request)\nb = 2\n")
    profile = "\n".join(
        [
            f"{ROUTER};serve (router/cli.py:10);_Connection.send (router/proxy.py:2) 5",  # a write line
            f"{ROUTER};serve (router/cli.py:10);_Connection.send (router/proxy.py:3) 2",  # its protocol
            f"{ROUTER};Runner.run (asyncio/runners.py:118) 4",
            f"{ROUTER};x (router/fastpath.py:5);y (uvicorn/protocols/http/httptools_impl.py:9) 3",
            f"{ROUTER};Router.decide (router/routing.py:400) 6",
            f"{ROUTER};deepcopy (copy.py:1) 1",
            f"{ROUTER};<module> (router/app.py:1);_find_and_load (<frozen importlib._bootstrap>:1176) 50",
            f"{OTHER};Router.decide (router/routing.py:400) 40",
        ]
    )
    kept, parts, functions = pyspy_split.split(profile, "--policy tier_cost", tmp_path)
    assert kept == 21  # the start-up stack and the other process are out
    assert parts == {
        "socket writes": 5,
        "upstream protocol": 2,
        "event loop": 4,
        "client protocol": 3,
        "kvroute's own work": 6,
        "other": 1,
    }
    assert functions["_Connection.send (router/proxy.py)"] == 7
