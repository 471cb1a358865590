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
MODULE = "router/first_byte.py"  # small, on the request path, imported by router.app

# Run inside the copy: where router.first_byte came from, and that the router's app builds on it.
_REPORT = """
import json
import router.app, router.first_byte
from router.config import load_config
budget = router.first_byte.FirstByteBudget(fixed_s=1.5)
config = load_config(environ={}, overrides={
    "engines": [{"id": "e0", "url": "http://127.0.0.1:9", "model": "m"}], "health": {"interval_s": 0}})
router.app.create_app(config)
module = router.first_byte
print(json.dumps({"origin": module.__spec__.origin, "loader": type(module.__loader__).__name__,
                  "budget_s": budget.budget_s()}))
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


@pytest.mark.slow  # runs mypyc and the C compiler (about a minute)
def test_a_module_built_compiled_is_imported_in_place_of_its_source_and_cleaned(tmp_path: Path) -> None:
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler")
    root = tmp_path / "kvroute"
    for folder in ("kvcore", "router", "policies", "sim", "loadtest", "tools"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    pure = _report(root)
    assert str(pure["origin"]).endswith("first_byte.py") and pure["budget_s"] == 1.5, pure

    built = _tool(root, "build", "--modules", MODULE)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    assert "router/first_byte." in built.stdout and "kvcore/compiled__mypyc." in built.stdout, built.stdout
    report = _report(root)
    assert str(report["origin"]).endswith(".so") and report["loader"] == "ExtensionFileLoader", report
    assert report["budget_s"] == 1.5, report  # the compiled module computes as the source does

    cleaned = _tool(root, "clean")
    assert cleaned.returncode == 0 and "removed 2 compiled extension(s)" in cleaned.stdout, cleaned.stdout
    assert str(_report(root)["origin"]).endswith("first_byte.py")


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
