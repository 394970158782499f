"""The cost model: what a prefill, a fetch and a request's placement cost in time.

One decision, used by the Serve router (scoring a node), the engine (fetching before its
prefill) and `kvfabric replay` (both): fetch the pages another node holds beyond this one's
when moving them takes less time than computing them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.policies import AttentionPolicy, FullAttentionPolicy, policies_for


class Geometry(Protocol):
    """What timing a prefill reads of a model's config."""

    @property
    def page_size(self) -> int: ...
    @property
    def max_positions(self) -> int: ...
    @property
    def vocab(self) -> int: ...


class Prefills(Protocol):
    """A model that can be timed (kvfabric.deploy.reference.model.TinyLM has it)."""

    @property
    def config(self) -> Geometry: ...

    def prefill(self, tokens: Sequence[int], past: Any = None) -> object: ...


@dataclass(frozen=True)
class CostModel:
    """Fetch the extra pages when moving them takes less time than computing them; a page
    a node holds below its device is read up at its tier's bandwidth."""

    prefill_tokens_per_s: float
    transfer_bytes_per_s: float = 10e9  # about a 100 Gb/s NIC
    fetch_overhead_s: float = 2e-3  # lookup, export grant, lease, commit
    # Host to device: PCIe 4.0 x16 as copies reach it (32 GB/s on paper).
    host_read_bytes_per_s: float = 25e9
    # Disk to device: one PCIe 4.0 NVMe drive's sequential read (3.5 for PCIe 3.0, 7 at best).
    disk_read_bytes_per_s: float = 5e9

    def __post_init__(self) -> None:
        for name in (
            "prefill_tokens_per_s",
            "transfer_bytes_per_s",
            "host_read_bytes_per_s",
            "disk_read_bytes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.fetch_overhead_s >= 0:
            raise ValueError(f"fetch_overhead_s must be >= 0, got {self.fetch_overhead_s!r}")

    def recompute_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def transfer_s(self, nbytes: int) -> float:
        return self.fetch_overhead_s + nbytes / self.transfer_bytes_per_s

    def load_s(self, tier: Tier, nbytes: int, disk_read_bytes_per_s: float = 0.0) -> float:
        """Reading `nbytes` of a node's own pages on `tier` up to its device; a disk read at
        `disk_read_bytes_per_s` where the node measured it (0: this model's figure)."""
        if tier is Tier.DEVICE:
            return 0.0
        if tier is Tier.HOST:
            return nbytes / self.host_read_bytes_per_s
        return nbytes / (disk_read_bytes_per_s or self.disk_read_bytes_per_s)

    def should_fetch(self, tokens: int, nbytes: int, read_s: float = 0.0) -> bool:
        """Whether moving `nbytes` (after the source's `read_s` reading them up) beats
        computing `tokens`."""
        return tokens > 0 and self.transfer_s(nbytes) + read_s < self.recompute_s(tokens)

    @classmethod
    def measure(
        cls,
        model: Prefills,
        *,
        transfer_bytes_per_s: float = 10e9,
        fetch_overhead_s: float = 2e-3,
        pages: int = 4,
    ) -> "CostModel":
        """Time a short prefill on this node's model (after one warm-up run)."""
        cfg = model.config
        n = min(pages * cfg.page_size, cfg.max_positions)
        tokens = [i % cfg.vocab for i in range(n)]
        model.prefill(tokens)
        start = time.perf_counter()
        model.prefill(tokens)
        elapsed = max(time.perf_counter() - start, 1e-9)
        return cls(n / elapsed, transfer_bytes_per_s, fetch_overhead_s)


class PageBytes:
    """Bytes a fetch of `pages` more pages moves: per pool, the pages its attention policy
    needs of them (every one for full attention, the last window's for SWA) at that pool's
    page size."""

    def __init__(
        self, sizes: Mapping[PoolName, int], policies: Mapping[PoolName, AttentionPolicy]
    ) -> None:
        self.sizes, self.policies = dict(sizes), dict(policies)

    @classmethod
    def of(cls, layout: KVLayout) -> "PageBytes":
        return cls({p: layout.page_bytes(p) for p in layout.pools}, policies_for(layout))

    @classmethod
    def full(cls, page_bytes: int) -> "PageBytes":
        """Full attention only, `page_bytes` a page."""
        return cls({PoolName.FULL: page_bytes}, {PoolName.FULL: FullAttentionPolicy()})

    def fetch(self, pages: int) -> int:
        return sum(len(self.policies[p].needed(pages)) * size for p, size in self.sizes.items())


@dataclass(frozen=True)
class Prompt:
    """A prompt as placement sees it: its length in tokens and its page size. A page
    count converts to tokens capped at the length (the last page may be partial)."""

    tokens: int
    page_tokens: int

    def hit_tokens(self, pages: int) -> int:
        return min(pages * self.page_tokens, self.tokens)


@dataclass(frozen=True)
class Plan:
    """What a node holding `have` pages does when some node holds `best`."""

    cached_pages: int  # after the fetch, if any
    fetched_pages: int
    fetched_bytes: int
    fetch_s: float
    prefill_s: float  # computing what is still missing

    @property
    def seconds(self) -> float:
        return self.fetch_s + self.prefill_s


def plan(
    cost: CostModel,
    sizes: PageBytes,
    prompt: Prompt,
    have: int,
    best: int,
    source_tier: Tier = Tier.DEVICE,
    source_disk_read_bytes_per_s: float = 0.0,
) -> Plan:
    """Fetch the pages from `have` to `best` when the cost model says moving them (the
    source reading them up from `source_tier` first) beats recomputing them; otherwise
    compute them."""
    extra_pages = max(0, best - have)
    extra = prompt.hit_tokens(best) - prompt.hit_tokens(have) if extra_pages else 0
    nbytes = sizes.fetch(extra_pages)
    read_s = cost.load_s(source_tier, nbytes, source_disk_read_bytes_per_s)
    if extra_pages and cost.should_fetch(extra, nbytes, read_s):
        return Plan(
            best,
            extra_pages,
            nbytes,
            cost.transfer_s(nbytes) + read_s,
            cost.recompute_s(prompt.tokens - prompt.hit_tokens(best)),
        )
    return Plan(have, 0, 0, 0.0, cost.recompute_s(prompt.tokens - prompt.hit_tokens(have)))
