"""Routing policies: a pure library (no I/O). One file per policy, each registering itself by name.

Importing this package imports every policy module in it, so ``policies.base.build_policy(name)``
finds a new policy file without any change to the server.
"""

import importlib
import pkgutil

_NOT_POLICIES = {"base", "costs"}

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name not in _NOT_POLICIES and not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")
