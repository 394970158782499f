"""The prefix index's presence table: per page key, which node slots hold it, and how.

Per key, a 4-bit nibble per node slot (see prefix_index._code), packed in one int in
this pure-Python reference, in a bitset of 16 slots a word in the C core
(csrc/presence.c, `_presence.Presence`, the same methods and results). Keys keep
insertion order as a dict does. KVF_NATIVE picks the core once per process, as for
page keys (fabric/cache/native.py); `new_presence(rule, native=...)` picks one
explicitly, as the differential tests do. The table knows slots, not node names, epochs
or what a node published: PrefixIndex keeps those and validates every input first."""

from __future__ import annotations

from itertools import repeat
from operator import and_, or_
from types import ModuleType
from typing import Protocol, Sequence

from ..cache import native
from .events import KEY_BYTES
from .lookups import Lookups, Match
from .match_rule import MatchRule


class PresenceTable(Protocol):
    def open(self, slot: int, /) -> None: ...

    def close(self, slot: int, /) -> None: ...

    def set(self, slot: int, keys: Sequence[bytes], code: int, /) -> list[bytes] | None: ...

    def lookup(self, keys: Sequence[bytes], /) -> list[Match]: ...

    def keys(self) -> list[bytes]: ...

    def get(self, key: bytes, /) -> int: ...

    def __len__(self) -> int: ...


class Presence(Lookups):
    """The pure-Python core: key -> packed nibbles (never 0: a key no slot holds is deleted)."""

    def __init__(self, window_pages: int, has_full: bool) -> None:
        self.window_pages, self.has_full = window_pages, has_full
        self._bits: dict[bytes, int] = {}
        self._ones = 0

    def open(self, slot: int) -> None:
        self._ones |= 1 << 4 * slot

    def close(self, slot: int) -> None:
        """The slot is free; its nibbles must be cleared first (set(slot, keys, 0))."""
        self._ones &= ~(1 << 4 * slot)

    def set(self, slot: int, keys: Sequence[bytes], code: int) -> list[bytes] | None:
        """The slot's nibble `code` for each key, in order: C-level passes. Code 0 clears,
        and returns the keys it deleted (no slot holds them any more)."""
        shift, b = 4 * slot, self._bits
        keep = ~(0xF << shift)
        if code:
            b.update(
                zip(
                    keys,
                    map(
                        or_,
                        map(and_, map(b.get, keys, repeat(0)), repeat(keep)),
                        repeat(code << shift),
                    ),
                )
            )
            return None
        left = list(map(and_, map(b.get, keys, repeat(0)), repeat(keep)))
        if all(left):  # every key held before, and by some other slot still
            b.update(zip(keys, left))
            return []
        removed = []
        for key in keys:  # in order: a key listed twice is deleted once
            bits = b.get(key)
            if bits is None:
                continue
            if bits & keep:
                b[key] = bits & keep
            else:
                del b[key]
                removed.append(key)
        return removed

    def keys(self) -> list[bytes]:
        return list(self._bits)

    def get(self, key: bytes) -> int:
        return self._bits.get(key, 0)

    def __len__(self) -> int:
        return len(self._bits)


def _import() -> ModuleType:
    from . import _presence  # type: ignore[attr-defined]  # built C: mypy sees no source

    return _presence


EXT: ModuleType | None = native.load(native.MODE, _import)
if EXT is not None and EXT.KEY_BYTES != KEY_BYTES:
    raise ImportError(
        f"the native index extension is stale (KEY_BYTES {EXT.KEY_BYTES}): "
        "rebuild it with `pip install -e .`"
    )
ENABLED = EXT is not None


def new_presence(rule: MatchRule, native: bool | None = None) -> PresenceTable:
    """An empty table for `rule`: the C core or the reference (default: KVF_NATIVE's pick)."""
    if native and EXT is None:
        raise RuntimeError("the native index core asked for, but its extension is not loaded")
    if EXT is not None and native is not False:
        table: PresenceTable = EXT.Presence(rule.window_pages, rule.has_full)
        return table
    return Presence(rule.window_pages, rule.has_full)
