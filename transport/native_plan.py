"""The read plan's C extension (transport/csrc/plan.c) as KVF_NATIVE picks it, or None
for the numpy reference in base.py (see kvfabric.core.cache.native)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Protocol

from kvfabric.core.cache import native


class PlanExtension(Protocol):
    """What transport/csrc/plan.c exports (the `_plan` module)."""

    def order(
        self,
        remote: object,
        local: object,
        remote_capacity: int,
        local_capacity: int,
        out_remote: object,
        out_local: object,
        /,
    ) -> int: ...


def _import() -> ModuleType:
    # By its full name: `from . import _plan` reads as an import of this package.
    return importlib.import_module(f"{__package__}._plan")


PLAN: PlanExtension | None = native.load(native.MODE, _import)  # type: ignore[assignment]
