"""Page-index allocator: O(1) alloc, free and take, with misuse detected."""

from __future__ import annotations


class AllocatorError(RuntimeError):
    """A page index was freed twice, or does not belong to this allocator."""


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Hands out page indices in [0, capacity).

    Free indices are a stack (a list) and used ones a set, so alloc and free
    of n pages are a few C-level list and set operations. A fresh allocator
    hands out ascending indices, so early allocations form contiguous runs.
    """

    __slots__ = ("capacity", "_free", "_used")

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
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
        unique = set(indices)
        if (
            len(unique) == len(indices)
            and (unique <= self._used if want_used else unique.isdisjoint(self._used))
            and all(type(i) is int and 0 <= i < self.capacity for i in unique)
        ):
            return
        seen = set()
        for i in indices:
            if not isinstance(i, int) or not 0 <= i < self.capacity:
                raise AllocatorError(
                    f"page {i!r} is not in this allocator (capacity {self.capacity})"
                )
            if i in seen or (i in self._used) != want_used:
                state = "free" if want_used else "in use"
                raise AllocatorError(f"page {i} is already {state}")
            seen.add(i)
