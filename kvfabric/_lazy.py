"""Public names imported on first use (PEP 562). A package's `__init__` maps each name it
exports to the module that defines it; importing the package, or any module below it,
then imports none of them: an index shard's process, which imports a few modules of
`kvfabric.core`, never imports the node cache, torch or NIXL."""

from __future__ import annotations

import importlib
from typing import Any, Mapping


def load(namespace: dict[str, Any], where: Mapping[str, str], name: str) -> Any:
    """The package's attribute `name` (its `__getattr__`): imported from the module
    `where` names for it (relative to the package), and kept in the package's
    `namespace` so later lookups find it there."""
    module = where.get(name)
    package = namespace["__name__"]
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, package), name)
    namespace[name] = value
    return value


def names(namespace: dict[str, Any], where: Mapping[str, str]) -> list[str]:
    """The package's `__dir__`: what it holds and what it exports."""
    return sorted(set(namespace) | set(where))
