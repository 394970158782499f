"""The read plan's C extension (transport/csrc/plan.c) as KVF_NATIVE picks it, or None
for the numpy reference in base.py (see kvfabric.fabric.cache.native)."""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

from kvfabric.fabric.cache import native


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
    from . import _plan  # type: ignore[attr-defined]  # built C: mypy sees no source

    return _plan


PLAN: PlanExtension | None = native.load(native.MODE, _import)  # type: ignore[assignment]
