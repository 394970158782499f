"""vLLM's KV cache config as the fabric sees it: a KVLayout and where each layer lives.

Full-attention groups go to the FULL pool, sliding-window groups to the SWA pool; one
fabric page per vLLM block. With the hybrid allocator off, vLLM gives windowed layers
a FullAttentionSpec and keeps their KV for every position: they are stored whole, in
the FULL pool. A page holds every KV head: under tensor parallelism each rank copies
its own heads (`HeadShard`), so pages do not depend on how the engine is split. The
layout's tag is the engine's KV identity (kv_identity.py), set by the scheduler side;
workers only copy bytes and need the geometry alone. Pages have one format whatever the
attention backend (block_format.py converts), so the backend is not in the tag.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
from kvfabric.core.cache.layout import KVLayout, LayerKind, PoolName

NULL_BLOCK = 0  # vLLM's null block (SWA blocks outside the window point at it)
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.uint8: "uint8",  # vLLM's fp8 caches (which fp8: the identity's kv_cache_dtype)
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class PlanError(ValueError):
    """vLLM's KV cache config does not map onto a fabric layout."""


@dataclass(frozen=True)
class LayerSlot:
    name: str  # vLLM's layer name
    group: int  # its KV cache group
    pool: PoolName
    index: int  # position among the pool's layers (the fabric page's layer axis)


@dataclass(frozen=True)
class HeadShard:
    """The KV heads of a page one tensor-parallel rank holds: heads [first, first +
    count). Where there are fewer KV heads than ranks, vLLM replicates each over several
    ranks; the first of them writes it (`writes`), all of them read it."""

    first: int
    count: int
    writes: bool = True

    @classmethod
    def of(cls, rank: int, ranks: int, heads: int) -> "HeadShard":
        if not 0 <= rank < ranks:
            raise PlanError(f"rank {rank} of {ranks}")
        if heads >= ranks:
            if heads % ranks:
                raise PlanError(f"{heads} KV heads do not split over {ranks} ranks")
            per = heads // ranks
            return cls(rank * per, per, True)
        if ranks % heads:
            raise PlanError(f"{ranks} ranks do not share {heads} KV heads evenly")
        replicas = ranks // heads
        return cls(rank // replicas, 1, rank % replicas == 0)


@dataclass(frozen=True)
class EnginePlan:
    layout: KVLayout  # every KV head: pages do not depend on the engine's split
    layers: tuple[LayerSlot, ...]
    group_pools: tuple[PoolName, ...]  # per KV cache group
    ranks: int = 1  # tensor-parallel ranks: a save is whole once each has copied its heads

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def groups_of(self, pool: PoolName) -> list[int]:
        return [g for g, p in enumerate(self.group_pools) if p == pool]

    def shard(self, rank: int) -> HeadShard:
        return HeadShard.of(rank, self.ranks, self.layout.kv_heads)

    def with_tag(self, tag: str) -> "EnginePlan":
        """The same plan, its pages named by `tag` (the engine's KV identity)."""
        return dataclasses.replace(self, layout=dataclasses.replace(self.layout, tag=tag))


def plan_from_kv_cache_config(kv_cache_config: Any, vllm_config: Any) -> EnginePlan:
    """The plan for an engine's KV cache config (vllm.v1.kv_cache_interface.KVCacheConfig),
    untagged; a PlanError names what the fabric cannot store."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    parallel = vllm_config.parallel_config
    for what, size in (
        ("pipeline parallelism", parallel.pipeline_parallel_size),
        ("decode context parallelism", getattr(parallel, "decode_context_parallel_size", 1)),
        ("prefill context parallelism", getattr(parallel, "prefill_context_parallel_size", 1)),
    ):
        if size != 1:
            raise PlanError(
                f"{what} ({size}) splits a request's KV over ranks: the FabricConnector "
                "supports tensor parallelism only"
            )
    spec_decode = getattr(vllm_config, "speculative_config", None)
    if spec_decode is not None and (spec_decode.use_eagle() or spec_decode.uses_draft_model()):
        raise PlanError(
            f"speculative decoding by {spec_decode.method!r} keeps a drafter's KV beside the "
            "model's: the FabricConnector supports n-gram speculation only"
        )
    ranks = parallel.tensor_parallel_size
    heads = vllm_config.model_config.get_total_num_kv_heads()
    kinds: dict[str, tuple[int, LayerKind]] = {}
    group_pools: list[PoolName] = []
    geometry = set()
    window = 0
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            kind, window = LayerKind.SWA, spec.sliding_window
        elif type(spec) is FullAttentionSpec:
            # Windowed or chunked layers with the hybrid allocator off keep every
            # position's KV (vLLM allocates them all): stored whole, as full attention.
            kind = LayerKind.FULL
        else:
            raise PlanError(
                f"KV cache group {g} has a {type(spec).__name__}: "
                "the fabric stores full and sliding-window attention only"
            )
        mode = getattr(spec, "kv_quant_mode", 0)
        if int(mode) > 1:  # 0: none, 1: fp8 with per-tensor scales (from the checkpoint)
            raise PlanError(
                f"KV cache group {g} quantizes KV as {getattr(mode, 'name', mode)}: scales "
                "kept per token are not part of a fabric page"
            )
        if getattr(spec, "head_size_v", spec.head_size) not in (None, spec.head_size):
            raise PlanError(
                f"KV cache group {g}: V heads of {spec.head_size_v} and K heads of "
                f"{spec.head_size}: the fabric stores K and V of one head size"
            )
        if getattr(group, "is_eagle_group", False):
            raise PlanError(f"KV cache group {g} is a drafter's (EAGLE): not supported")
        geometry.add((spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype))
        group_pools.append(PoolName.FULL if kind == LayerKind.FULL else PoolName.SWA)
        for name in group.layer_names:
            kinds[name] = (g, kind)
    if len(geometry) != 1:
        raise PlanError(
            f"KV cache groups differ in block size, heads or dtype: {sorted(map(str, geometry))}"
        )
    ((block_size, rank_heads, head_dim, dtype),) = geometry
    if dtype not in _DTYPE_NAMES:
        raise PlanError(f"unsupported KV dtype {dtype}")
    if rank_heads != max(1, heads // ranks):
        raise PlanError(
            f"{rank_heads} KV heads per rank: {heads} over {ranks} tensor-parallel ranks "
            f"should give {max(1, heads // ranks)}"
        )
    HeadShard.of(0, ranks, heads)  # a split the copies cannot follow fails here
    names = sorted(kinds, key=_layer_index)
    layout = KVLayout(
        layers=tuple(kinds[n][1] for n in names),
        kv_heads=heads,
        head_dim=head_dim,
        page_size=block_size,
        window=window,
        dtype=_DTYPE_NAMES[dtype],
    )
    pos = {p: 0 for p in PoolName}
    slots = []
    for name in names:
        g, _ = kinds[name]
        pool = group_pools[g]
        slots.append(LayerSlot(name, g, pool, pos[pool]))
        pos[pool] += 1
    return EnginePlan(layout, tuple(slots), tuple(group_pools), ranks)


def _layer_index(name: str) -> tuple[int, str]:
    m = _LAYER_INDEX.search(name)
    return (int(m.group(1)) if m else -1, name)
