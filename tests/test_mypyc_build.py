"""tools/mypyc_build.py, the opt-in mypyc build (docs/results/dp7.md): one small module compiled into
a copy of the project is imported in place of its source and still works, and ``clean`` removes it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# On the request path (every prompt's block keys), imported by router.app, and it imports nothing of
# kvroute: its build takes 8 s here, router/first_byte.py's (the module used before, whose type
# imports reach the whole router for mypyc to check) 24 s.
MODULE = "kvcore/keys.py"

# Run inside the copy: where kvcore.keys came from, that the router's app builds on it, and the
# keys of two blocks with an extra key (every branch of block_keys and the msgspec encoding).
_REPORT = """
import json
import router.app, kvcore.keys
from router.config import load_config
config = load_config(environ={}, overrides={
    "engines": [{"id": "e0", "url": "http://127.0.0.1:9", "model": "m"}], "health": {"interval_s": 0}})
router.app.create_app(config)
module = kvcore.keys
keys = module.block_keys(list(range(40)), 16, parent=module.namespace_seed("m"), extra_keys=[["lora", 7]])
print(json.dumps({"origin": module.__spec__.origin, "loader": type(module.__loader__).__name__,
                  "keys": keys}))
"""


def _report(root: Path) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def _tool(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "tools" / "mypyc_build.py"), *args, "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.slow  # runs mypyc and the C compiler (about 10 s)
def test_a_module_built_compiled_is_imported_in_place_of_its_source_and_cleaned(tmp_path: Path) -> None:
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler")
    root = tmp_path / "kvroute"
    for folder in ("kvcore", "router", "policies", "sim", "loadtest", "tools"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    pure = _report(root)
    assert str(pure["origin"]).endswith("keys.py") and len(pure["keys"]) == 2, pure

    built = _tool(root, "build", "--modules", MODULE)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    assert "kvcore/keys." in built.stdout and "kvcore/compiled__mypyc." in built.stdout, built.stdout
    report = _report(root)
    assert str(report["origin"]).endswith(".so") and report["loader"] == "ExtensionFileLoader", report
    assert report["keys"] == pure["keys"], report  # the compiled module computes as the source does

    cleaned = _tool(root, "clean")
    assert cleaned.returncode == 0 and "removed 2 compiled extension(s)" in cleaned.stdout, cleaned.stdout
    assert str(_report(root)["origin"]).endswith("keys.py")


def test_a_module_that_is_not_there_is_refused_by_name() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "mypyc_build.py"), "build", "--modules", "router/nope.py"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert "no such module under" in proc.stderr and "router/nope.py" in proc.stderr, proc.stderr
