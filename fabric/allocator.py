"""Page-index allocator: O(1) alloc, free and take, with misuse detected."""
from __future__ import annotations


class AllocatorError(RuntimeError):
    """A page index was freed twice, or does not belong to this allocator."""


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """Hands out page indices in [0, capacity).

    Free indices live in an insertion-ordered dict used as a stack: popitem,
    insert and delete of a given index are all O(1). Fresh allocators hand out
    ascending indices, so early allocations form contiguous runs.
    """

    __slots__ = ("capacity", "_free", "_used")

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._free = dict.fromkeys(range(capacity - 1, -1, -1))
        self._used = bytearray(capacity)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"want {n} pages, {len(self._free)} free of {self.capacity}")
        pop = self._free.popitem
        out = [pop()[0] for _ in range(n)]
        used = self._used
        for i in out:
            used[i] = 1
        return out

    def free(self, indices: list[int]) -> None:
        self._check(indices, want_used=True)
        for i in indices:
            self._used[i] = 0
            self._free[i] = None

    def take(self, indices: list[int]) -> None:
        """Mark specific free indices used (undo of a free)."""
        self._check(indices, want_used=False)
        for i in indices:
            del self._free[i]
            self._used[i] = 1

    def is_used(self, index: int) -> bool:
        return 0 <= index < self.capacity and bool(self._used[index])

    def used_indices(self) -> set[int]:
        return {i for i, u in enumerate(self._used) if u}

    def _check(self, indices: list[int], want_used: bool) -> None:
        seen = set()
        for i in indices:
            if not isinstance(i, int) or not 0 <= i < self.capacity:
                raise AllocatorError(f"page {i!r} is not in this allocator (capacity {self.capacity})")
            if i in seen or bool(self._used[i]) != want_used:
                state = "free" if want_used else "in use"
                raise AllocatorError(f"page {i} is already {state}")
            seen.add(i)
