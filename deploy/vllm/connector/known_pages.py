"""Pages this engine knows its node holds, named by vLLM's block hashes.

A request whose whole prompt vLLM's own prefix cache holds asks the node nothing at
admission, so nothing tells the scheduler side what the node holds of it: its prompt's
save would copy every page to staging again (a 16k-token prompt of the bench's model:
64 MiB, each such request) for the node to find it held them all. vLLM's block hashes
chain over the whole prefix and cover what vLLM keys its own cache by (the cache salt,
LoRA adapter, multimodal inputs), so the hash that ends page i names pages 0..i.

What is known here only ever skips a save, never serves KV: a page the node has evicted
since stays unsaved until vLLM drops it too, and then the request's lookup asks the
node and the save copies what it lacks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence

CAPACITY = 1 << 16  # pages remembered (least recently learned dropped first)


class KnownPages:
    def __init__(self, page_size: int, hash_block_size: int | None, capacity: int = CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        # vLLM hashes blocks of hash_block_size tokens: a page ends on every r-th hash.
        # Where pages do not end on hash boundaries, nothing is known (every save copies).
        self.per_page = 0
        if hash_block_size and page_size % hash_block_size == 0:
            self.per_page = page_size // hash_block_size
        self.capacity = capacity
        self._held: OrderedDict[Hashable, None] = OrderedDict()

    def of(self, block_hashes: Sequence[Hashable], pages: int) -> tuple[Hashable, ...]:
        """The hash that ends each of the first `pages` pages (fewer where vLLM has not
        hashed that far)."""
        r = self.per_page
        if not r or pages <= 0:
            return ()
        return tuple(block_hashes[r - 1 : pages * r : r])

    def add(self, hashes: Sequence[Hashable]) -> None:
        """The node holds these pages (a store or a load through it succeeded)."""
        held = self._held
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def leading(self, hashes: Sequence[Hashable]) -> int:
        """How many pages from the first on are known held."""
        n = 0
        for h in hashes:
            if h not in self._held:
                break
            n += 1
        return n

    def forget(self) -> None:
        """The node failed a call: what it holds is no longer known."""
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)
