"""The row copy's C extension (core/cache/csrc/copy.c) as KVF_NATIVE picks it, or None
for the torch reference in page_bytes.py (see native.py)."""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

from . import native


class CopyTicket(Protocol):
    """The copies of one CopyQueue.submit."""

    # Once done (time.monotonic_ns(); the queue thread's CPU time); None before.
    started_ns: int | None
    ended_ns: int | None
    cpu_ns: int | None

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None, /) -> bool: ...


class CopyQueue(Protocol):
    """Copies run in the order submitted, on a C thread that never takes the GIL."""

    # The thread's kernel id once it has run (after a submit's ticket is done); else None.
    native_id: int | None

    def submit(self, copies: object, /) -> CopyTicket: ...


class CopyExtension(Protocol):
    """What core/cache/csrc/copy.c exports (the `_copy` module)."""

    def copy_rows(
        self, src: object, src_rows: object, dst: object, dst_rows: object, /
    ) -> None: ...

    def CopyQueue(self) -> CopyQueue: ...


def _import() -> ModuleType:
    from . import _copy  # type: ignore[attr-defined]  # built C: mypy sees no source

    return _copy


COPY: CopyExtension | None = native.load(native.MODE, _import)  # type: ignore[assignment]
