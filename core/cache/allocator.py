"""Page-index allocator: O(1) alloc, free and take, with misuse detected.

Two implementations with the same API, page order, errors and messages: the C type
(core/cache/csrc/allocator.c: an int32 free stack and a used bitmap, holding no Python
objects, so the garbage collector does not track it) and the pure-Python reference
below. KVF_NATIVE picks one per process (native.py); `PageAllocator(capacity,
native=...)` picks one per allocator (tests).
"""

from __future__ import annotations

from abc import ABCMeta
from types import ModuleType

from . import native

MAX_PAGES = 2**31 - 1  # the native allocator keeps page indices as int32


class AllocatorError(RuntimeError):
    """A page index was freed twice, or does not belong to this allocator."""


class OutOfPages(RuntimeError):
    pass


def _import() -> ModuleType:
    from . import _alloc  # type: ignore[attr-defined]  # built C: mypy sees no source

    return _alloc


EXT: ModuleType | None = native.load(native.MODE, _import)
if EXT is not None:
    if EXT.MAX_PAGES != MAX_PAGES:
        raise ImportError(
            f"the native allocator is stale (MAX_PAGES {EXT.MAX_PAGES}): "
            "rebuild it with `pip install -e .`"
        )
    EXT.set_errors(AllocatorError, OutOfPages)
ENABLED = EXT is not None


class PageAllocator(metaclass=ABCMeta):
    """Hands out page indices in [0, capacity).

    Free indices are a stack (a list) and used ones a set, so alloc and free
    of n pages are a few C-level list and set operations. A fresh allocator
    hands out ascending indices, so early allocations form contiguous runs.
    """

    __slots__ = ("capacity", "_free", "_used")

    def __new__(cls, capacity: int, native: bool | None = None) -> PageAllocator:
        # The native object stands in for the reference (Python then skips __init__); its
        # type is registered below as a virtual subclass, so isinstance holds for both.
        if native and EXT is None:
            raise RuntimeError(
                "the native page allocator asked for, but its extension is not loaded"
            )
        if cls is PageAllocator and EXT is not None and native is not False:
            made: PageAllocator = EXT.PageAllocator(capacity)
            return made
        return super().__new__(cls)

    def __init__(self, capacity: int, native: bool | None = None) -> None:
        if (
            type(capacity) is bool
            or not isinstance(capacity, int)
            or not 0 <= capacity <= MAX_PAGES
        ):
            raise ValueError(f"capacity must be an int in [0, {MAX_PAGES}], got {capacity!r}")
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int]:
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"n must be an int, got {n!r}")
        free = self._free
        if n > len(free):
            raise OutOfPages(f"want {n} pages, {len(free)} free of {self.capacity}")
        if n <= 0:
            return []
        out = free[-n:]
        del free[-n:]
        out.reverse()
        self._used.update(out)
        return out

    def free(self, indices: list[int]) -> None:
        self._check(indices, want_used=True)
        self._used.difference_update(indices)
        self._free.extend(reversed(indices))

    def take(self, indices: list[int]) -> None:
        """Mark specific free indices used (undo of a free; O(capacity), so rare)."""
        self._check(indices, want_used=False)
        gone = set(indices)
        self._free = [i for i in self._free if i not in gone]
        self._used.update(indices)

    def used_indices(self) -> set[int]:
        return set(self._used)

    def _check(self, indices: list[int], want_used: bool) -> None:
        """Raises, naming the first bad page, unless `indices` are distinct pages (ints,
        not bools) all in use (want_used) or all free."""
        if not isinstance(indices, (list, tuple)):
            raise TypeError(
                f"indices must be a list or tuple of ints, got {type(indices).__name__}"
            )
        try:
            unique = set(indices)
        except TypeError:  # an unhashable item: the loop below names it
            unique = None
        if (
            unique is not None
            and len(unique) == len(indices)
            and (unique <= self._used if want_used else unique.isdisjoint(self._used))
            and all(type(i) is int and 0 <= i < self.capacity for i in unique)
        ):
            return
        seen = set()
        for i in indices:
            if type(i) is not int or not 0 <= i < self.capacity:
                raise AllocatorError(
                    f"page {i!r} is not in this allocator (capacity {self.capacity})"
                )
            if i in seen or (i in self._used) != want_used:
                state = "free" if want_used else "in use"
                raise AllocatorError(f"page {i} is already {state}")
            seen.add(i)


if EXT is not None:
    PageAllocator.register(EXT.PageAllocator)
