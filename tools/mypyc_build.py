"""A mypyc build of kvroute's hot-path modules (issue 26, round dp7, measured in
docs/results/dp7.md: no gain, so no Makefile target or install path uses it): compiles them to C
extensions next to their sources, or removes every such extension again. Nothing in kvroute imports
this script, and a module runs the same with or without its extension (Python imports the extension
when it is there).

    python tools/mypyc_build.py build [--root DIR] [--modules router/load.py,...]
    python tools/mypyc_build.py clean [--root DIR]

Needs mypy (the dev extra ships mypyc with it), a C compiler and the Python headers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcore", "router", "policies", "sim", "loadtest")

#: The modules compiled by default: the per-request path that mypyc compiles as written. Left out,
#: with the reason (docs/results/dp7.md): router/proxy.py, router/routing.py, router/app.py (async
#: generators: ``iter_any``, the lifespan, and until round dp20 the answer relay, which is a plain
#: coroutine since; mypyc does not implement them; routing.py not tried again since),
#: router/guard.py (a class defined inside a function, the guarded protocol), policies/base.py
#: (interpreted policies subclass BasePolicy), policies/round_robin.py and tier_cost.py (a class
#: decorator, ``@register``, makes a non-extension class, which may not subclass BasePolicy once
#: compiled; interpreted, mypyc fails on tier_cost's nested functions), kvcore/wire.py (compiled
#: msgspec Structs check a field's ``msgspec.field(...)`` default against its annotation on import).
COMPILED_MODULES = (
    "router/fastpath.py",
    "router/first_byte.py",
    "router/load.py",
    "router/metrics.py",
    "kvcore/core.py",
    "kvcore/index.py",
    "kvcore/keys.py",
    "policies/costs.py",
)
#: mypyc puts the compiled code in one shared library that every module's extension imports; inside
#: a package (kvcore/compiled__mypyc.*.so) so that an editable install finds it from any folder.
GROUP_NAME = "kvcore.compiled"
BUILD_DIR = Path("build") / "mypyc"


@contextlib.contextmanager
def _inside(folder: Path) -> Iterator[None]:
    """mypyc takes module paths relative to the working directory, and reads the mypy settings of
    pyproject.toml there."""
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def extensions_in(root: Path) -> list[Path]:
    """Every compiled extension module inside kvroute's packages under ``root`` (kvroute has no
    other C extensions, so these are all mypyc's)."""
    return sorted(
        {
            path
            for package in PACKAGES
            for suffix in EXTENSION_SUFFIXES  # ".so" also matches the longer suffixes: a set
            for path in (root / package).rglob(f"*{suffix}")
        }
    )


def clean(root: Path) -> list[Path]:
    """Remove the compiled extensions and mypyc's build folder; returns the removed extensions."""
    removed = extensions_in(root)
    for path in removed:
        path.unlink()
    shutil.rmtree(root / BUILD_DIR, ignore_errors=True)
    return removed


def build(root: Path, modules: Sequence[str] = COMPILED_MODULES, jobs: int = 1) -> list[Path]:
    """Compile ``modules`` (paths relative to ``root``) in place; returns the extensions built.
    Raises RuntimeError naming what failed (mypyc's own errors are printed above it)."""
    missing = [m for m in modules if not (root / m).is_file()]
    if missing:
        raise RuntimeError(f"no such module under {root}: {', '.join(missing)}")
    try:
        from mypyc.build import mypycify
        from setuptools import Distribution
    except ImportError as exc:
        raise RuntimeError(
            f"{exc.name} is not installed: the dev extra has it (pip install -e '.[dev]')"
        ) from None
    clean(root)  # a module dropped from the list must not keep a stale extension
    with _inside(root):
        try:
            ext_modules = mypycify(list(modules), target_dir=str(BUILD_DIR), group_name=GROUP_NAME)
        except SystemExit:  # mypyc exits on a type or compile error after printing it
            raise RuntimeError(f"mypyc could not compile {', '.join(modules)}") from None
        # A Distribution of its own: setup() would read the project's pyproject.toml, which needs a
        # newer setuptools than a venv may have, for nothing this build uses.
        dist = Distribution({"name": "kvroute-compiled", "ext_modules": ext_modules})
        dist.script_name = "mypyc_build"
        dist.script_args = ["-q", "build_ext", "--inplace", "--build-temp", str(BUILD_DIR / "temp")]
        dist.script_args += ["--parallel", str(jobs)] if jobs > 1 else []
        dist.parse_command_line()
        dist.run_commands()
    built = extensions_in(root)
    if len(built) != len(modules) + 1:  # one per module and the shared library
        raise RuntimeError(f"expected {len(modules) + 1} extensions, built {len(built)}: {built}")
    return built


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("build", "clean"))
    parser.add_argument("--root", type=Path, default=REPO, help="the kvroute checkout (default: this one)")
    parser.add_argument(
        "--modules",
        default=",".join(COMPILED_MODULES),
        help="comma-separated module paths relative to --root (default: the hot-path set)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="C compilations in parallel")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.action == "clean":
            removed = clean(root)
            print(f"removed {len(removed)} compiled extension(s) under {root}")
            return 0
        modules = [m.strip() for m in args.modules.split(",") if m.strip()]
        built = build(root, modules, args.jobs)
    except RuntimeError as exc:
        print(f"mypyc_build: {exc}", file=sys.stderr)
        return 1
    print(f"compiled {len(modules)} module(s) under {root}:")
    for path in built:
        print(f"  {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
