"""The prefix index's core table: per page key, which node slots hold it and how, and
what each slot last published of it (its parent, depth and mask).

Per key, a code byte per node slot that holds it (see `code`), kept as its holders'
(slot, code) pairs while at most SPARSE_MAX slots hold it and as a bitset of every
slot's code where more do: memory and lookups cost per holder, not per slot the table
has. A dense key goes back to pairs when SPARSE_BACK slots hold it (not SPARSE_MAX, so
that a slot joining and leaving at the boundary does not switch it each time). In this
pure-Python reference pairs are a bytes of 3-byte (slot, code) entries and the bitset
one int; in the C core (csrc/, the `_presence.Presence` type: the same methods and
results, `dense` included) a 16-byte cell of inline pairs or a heap bitset. Per slot,
its pages in the order a dict keeps them; per key, the record of its last publication,
kept while any slot holds it (`meta`). Held keys keep insertion order as a dict does.
KVF_NATIVE picks the core once per process, as for page keys (core/cache/native.py);
`new_presence(rule, native=...)` picks one explicitly, as the differential tests do.
The table knows slots, not node names, epochs or sequence numbers: PrefixIndex keeps
those and validates every input before it calls here; the table checks its arguments
again (ValueError, nothing changed), as it cannot know its caller."""

from __future__ import annotations

from itertools import repeat
from types import ModuleType
from typing import Protocol, Sequence

from ..cache import native
from .events import _MAX_MASK, KEY_BYTES, MAX_DEPTH, PageMask
from .lookups import (
    _BYTES,
    _KEY_LEN,
    CODE_BITS,
    CODE_MASK,
    Holders,
    Lookups,
    Match,
    PackedMemo,
    packed,
    pairs,
)
from .match_rule import MatchRule

MAX_SLOTS = 1 << 16  # node slots a table may open (PrefixIndex reuses freed ones)
SPARSE_MAX = 5  # holders a key keeps as pairs; one more makes it dense
SPARSE_BACK = 3  # a dense key this few slots hold goes back to pairs

# Bits of a slot's code: FULL on any tier, FULL on device, SWA on any, SWA on device, then
# FULL in memory (device or host), SWA in memory. Each pool's bits say "on this tier or a
# faster one", so that ANDing codes along a path gives the slowest tier a match reads.
_F_ANY, _F_DEV, _S_ANY, _S_DEV, _F_MEM, _S_MEM = 1, 2, 4, 8, 16, 32


def code(mask: int) -> int:
    """A PageMask as a code whose bits AND sensibly along a path: FULL_DEVICE then
    FULL_HOST still means "FULL in memory on both", which ANDing raw masks would lose."""
    return (
        (_F_ANY if mask & PageMask.FULL else 0)
        | (_F_DEV if mask & PageMask.FULL_DEVICE else 0)
        | (_S_ANY if mask & PageMask.SWA else 0)
        | (_S_DEV if mask & PageMask.SWA_DEVICE else 0)
        | (_F_MEM if mask & (PageMask.FULL_DEVICE | PageMask.FULL_HOST) else 0)
        | (_S_MEM if mask & (PageMask.SWA_DEVICE | PageMask.SWA_HOST) else 0)
    )


_CODES = tuple(code(m) for m in range(_MAX_MASK + 1))  # mask -> code, without enum arithmetic

Page = tuple[bytes, bytes, int, int]  # (key, parent, depth, mask) as a slot last published it


class PresenceTable(Protocol):
    def open(self, slot: int, /) -> None: ...

    def close(self, slot: int, /) -> None: ...

    def set_chain(
        self, slot: int, keys: Sequence[bytes], first_depth: int, parent: bytes, mask: int, /
    ) -> None: ...

    def check(self, keys: list[bytes], parent: bytes, /) -> None: ...

    def clear(self, slot: int, /) -> None: ...

    def lookup(self, keys: Sequence[bytes], /) -> list[Match]: ...

    def pages(self, slot: int, /) -> list[Page]: ...

    def count(self, slot: int, /) -> int: ...

    def meta(self, key: bytes, /) -> tuple[bytes, int] | None: ...

    def keys(self) -> list[bytes]: ...

    def get(self, key: bytes, /) -> int: ...

    def dense(self, key: bytes, /) -> bool: ...

    def __len__(self) -> int: ...


# What one publication said of a run of consecutive pages: (keys, first depth, parent of
# keys[0], mask). Every key of the run maps to the one record, so that storing a chain is
# a C-level dict update with no object per page; a page's parent and depth follow from
# its position. A record lives while any of its keys still maps to it.
Chain = tuple[tuple[bytes, ...], int, bytes, int]


def resolve(key: bytes, rec: Chain) -> tuple[bytes, int, int]:
    """(parent, depth, mask) of a key in its record: the last place it has there, as
    applying the pages in order would leave it."""
    keys, depth, parent, mask = rec
    if len(keys) == 1:
        return parent, depth, mask
    i = len(keys) - 1 - keys[::-1].index(key)
    return keys[i - 1] if i else parent, depth + i, mask


def _count(bits: int) -> int:
    """Slots with a nonzero code in packed codes (a nonzero code has an ANY bit)."""
    x = bits | bits >> 2
    return (x & (1 << (x.bit_length() + 7 & ~7)) // 255).bit_count()


def _find(held: bytes, slot: bytes) -> int:
    """Where the pair of `slot` (2 bytes) starts in pairs, or -1."""
    for i in range(0, len(held), 3):
        if held[i : i + 2] == slot:
            return i
    return -1


class Presence(Lookups):
    """The pure-Python core: key -> its holders (never none: a key no slot holds is
    deleted), per open slot key -> its Chain record, and key -> its last record."""

    def __init__(self, window_pages: int, has_full: bool) -> None:
        self.window_pages, self.has_full = window_pages, has_full
        self._bits: dict[bytes, Holders] = {}
        self._ones = 0
        self._pages: list[dict[bytes, Chain] | None] = []  # per slot; None: not open
        self._meta: dict[bytes, Chain] = {}
        self._packed_of = PackedMemo()

    def open(self, slot: int) -> None:
        """The slot takes a node (nothing if it is open already)."""
        if type(slot) is not int or not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slot must be an int from 0 to {MAX_SLOTS - 1}, got {slot!r}")
        self._pages.extend(repeat(None, slot + 1 - len(self._pages)))
        if self._pages[slot] is None:
            self._pages[slot] = {}
        self._ones |= 1 << CODE_BITS * slot

    def close(self, slot: int) -> None:
        """The slot's pages are cleared and the slot is free."""
        self.clear(slot)
        self._pages[slot] = None
        self._ones &= ~(1 << CODE_BITS * slot)

    def set_chain(
        self, slot: int, keys: Sequence[bytes], first_depth: int, parent: bytes, mask: int
    ) -> None:
        """The slot publishes `keys` as consecutive pages from `first_depth` on, after
        `parent`, all with `mask` (0: it no longer holds them). Every argument is checked
        first, as the C core checks them (exact types, the same messages; ValueError,
        nothing changed): PrefixIndex's fast path relies on it."""
        pages = self._open(slot)
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)  # any sequence, as the C core takes one
        if keys and (set(map(type, keys)) != _BYTES or set(map(len, keys)) != _KEY_LEN):
            raise ValueError(f"chain keys must be {KEY_BYTES}-byte bytes")
        if (
            type(first_depth) is not int
            or first_depth < 0
            or first_depth + max(len(keys), 1) > MAX_DEPTH  # the last page's depth fits u64
        ):
            raise ValueError(
                f"first_depth must be an int from 0 to 2**64 - {max(len(keys), 1)}, "
                f"got {first_depth!r}"
            )
        if type(parent) is not bytes or len(parent) != KEY_BYTES:
            raise ValueError(f"chain parent must be {KEY_BYTES} bytes")
        if type(mask) is not int or not 0 <= mask <= _MAX_MASK:
            raise ValueError(f"mask must be an int from 0 to {_MAX_MASK}, got {mask!r}")
        if not mask:
            for key in keys:
                pages.pop(key, None)
            self._forget(self._set(slot, keys, 0))
            return
        self._set(slot, keys, _CODES[mask])
        rec = (tuple(keys), first_depth, parent, mask)
        pages.update(zip(keys, repeat(rec)))
        self._meta.update(zip(keys, repeat(rec)))

    @staticmethod
    def check(keys: list[bytes], parent: bytes) -> None:
        """A chain's keys and parent, before any state changes: the C core checks them in
        one pass, with these messages."""
        if keys and (set(map(type, keys)) != _BYTES or set(map(len, keys)) != _KEY_LEN):
            raise ValueError(f"chain keys must be {KEY_BYTES}-byte bytes")
        if type(parent) is not bytes or len(parent) != KEY_BYTES:
            raise ValueError(f"chain parent must be {KEY_BYTES} bytes")

    def clear(self, slot: int) -> None:
        """The slot holds nothing any more."""
        pages = self._open(slot)
        if pages:
            self._forget(self._set(slot, list(pages), 0))
            self._pages[slot] = {}

    def pages(self, slot: int) -> list[Page]:
        """What the slot holds, in the order it was published (a dict's order)."""
        pages, found = self._open(slot), {}
        for rec in {id(r): r for r in pages.values()}.values():  # each record once: O(pages)
            keys, depth, parent, mask = rec
            for i, k in enumerate(keys):
                if pages.get(k) is rec:
                    found[k] = (k, keys[i - 1] if i else parent, depth + i, mask)
        return [found[k] for k in pages]

    def count(self, slot: int) -> int:
        return len(self._open(slot))

    def meta(self, key: bytes) -> tuple[bytes, int] | None:
        """(parent, depth) of a held key, as last published by any slot."""
        if type(key) is not bytes or len(key) != KEY_BYTES:
            raise ValueError(f"meta key must be {KEY_BYTES}-byte bytes")
        rec = self._meta.get(key)
        return None if rec is None else resolve(key, rec)[:2]

    def keys(self) -> list[bytes]:
        return list(self._bits)

    def get(self, key: bytes) -> int:
        """The key's packed codes, whatever its form (0: not held)."""
        return packed(self._bits.get(key, 0))

    def dense(self, key: bytes) -> bool:
        """Whether the key's holders are a bitset, not pairs (False: not held)."""
        if type(key) is not bytes or len(key) != KEY_BYTES:
            raise ValueError(f"dense keys must be {KEY_BYTES}-byte bytes")
        return isinstance(self._bits.get(key), int)

    def __len__(self) -> int:
        return len(self._bits)

    def _open(self, slot: int) -> dict[bytes, Chain]:
        pages = self._pages[slot] if type(slot) is int and 0 <= slot < len(self._pages) else None
        if pages is None:
            raise ValueError(f"slot {slot!r} is not open")
        return pages

    def _set(self, slot: int, keys: Sequence[bytes], code: int) -> list[bytes] | None:
        """The slot's `code` for each key, in order. Code 0 clears, and returns the
        keys it deleted (no slot holds them any more)."""
        b, at = self._bits, bytes((slot >> 8, slot & 255))
        shift = CODE_BITS * slot
        keep = ~(CODE_MASK << shift)
        if code:
            pair, put = at + bytes((code,)), code << shift
            for key in keys:
                held = b.get(key)
                if held is None:
                    b[key] = pair
                elif isinstance(held, int):
                    b[key] = held & keep | put
                elif (i := _find(held, at)) >= 0:
                    b[key] = held[:i] + pair + held[i + 3 :]
                elif len(held) < 3 * SPARSE_MAX:
                    b[key] = held + pair
                else:  # one holder more than pairs keep: a bitset
                    b[key] = packed(held) | put
            return None
        removed = []
        for key in keys:  # in order: a key listed twice is deleted once
            held = b.get(key)
            if held is None:
                continue
            left: Holders
            if isinstance(held, int):
                bits = held & keep
                left = bits
                if bits != held and _count(bits) <= SPARSE_BACK:  # few hold it: pairs again
                    left = b"".join(bytes((s >> 8, s & 255, nib)) for s, nib in pairs(bits))
            elif (i := _find(held, at)) >= 0:
                left = held[:i] + held[i + 3 :]
            else:
                continue
            if left:
                b[key] = left
            else:
                del b[key]
                removed.append(key)
        return removed

    def _forget(self, removed: list[bytes] | None) -> None:
        """Drop the records of keys no slot holds any more."""
        for key in removed or ():
            del self._meta[key]


def _import() -> ModuleType:
    from . import _presence  # type: ignore[attr-defined]  # built C: mypy sees no source

    return _presence


EXT: ModuleType | None = native.load(native.MODE, _import)
if EXT is not None and (EXT.KEY_BYTES != KEY_BYTES or not hasattr(EXT.Presence, "set_chain")):
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
