"""vLLM's KV cache config as the fabric sees it: a KVLayout and where each layer lives.

Full-attention groups go to the FULL pool, sliding-window groups to the SWA pool; one
fabric page per vLLM block. The layout's tag names what else must match for two caches'
bytes to be interchangeable: the model, and the kind of device that computed the KV (a
GPU's kernels round differently from the CPU's, so their pages would not give the
outputs an uncached run gives). Pages have one format whatever the attention backend
(block_format.py converts), so the backend is not in the tag.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from kvfabric.fabric import KVLayout, LayerKind, PoolName

DEVICE_KINDS = ("cpu", "cuda")
NULL_BLOCK = 0  # vLLM's null block (SWA blocks outside the window point at it)
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
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
class EnginePlan:
    layout: KVLayout
    layers: tuple[LayerSlot, ...]
    group_pools: tuple[PoolName, ...]  # per KV cache group

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def groups_of(self, pool: PoolName) -> list[int]:
        return [g for g, p in enumerate(self.group_pools) if p == pool]


def model_tag(model: str, device: str) -> str:
    if device not in DEVICE_KINDS:
        raise PlanError(f"engines on {device!r}: the fabric serves {DEVICE_KINDS}")
    return f"vllm:{device}:{Path(model).name}"


def plan_from_kv_cache_config(kv_cache_config, model: str, device: str) -> EnginePlan:
    """The plan for an engine's KV cache config (vllm.v1.kv_cache_interface.KVCacheConfig)
    on `device` ("cpu" or "cuda")."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kinds: dict[str, tuple[int, LayerKind]] = {}
    group_pools: list[PoolName] = []
    geometry = set()
    window = 0
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            kind, window = LayerKind.SWA, spec.sliding_window
        elif type(spec) is FullAttentionSpec and not spec.sliding_window:
            kind = LayerKind.FULL
        else:
            raise PlanError(
                f"KV cache group {g} has a {type(spec).__name__}: "
                "the fabric stores full and sliding-window attention only"
            )
        geometry.add((spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype))
        group_pools.append(PoolName.FULL if kind == LayerKind.FULL else PoolName.SWA)
        for name in group.layer_names:
            kinds[name] = (g, kind)
    if len(geometry) != 1:
        raise PlanError(
            f"KV cache groups differ in block size, heads or dtype: {sorted(map(str, geometry))}"
        )
    ((block_size, kv_heads, head_dim, dtype),) = geometry
    if dtype not in _DTYPE_NAMES:
        raise PlanError(f"unsupported KV dtype {dtype}")
    names = sorted(kinds, key=_layer_index)
    layout = KVLayout(
        layers=tuple(kinds[n][1] for n in names),
        kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=block_size,
        window=window,
        dtype=_DTYPE_NAMES[dtype],
        tag=model_tag(model, device),
    )
    pos = {p: 0 for p in PoolName}
    slots = []
    for name in names:
        g, _ = kinds[name]
        pool = group_pools[g]
        slots.append(LayerSlot(name, g, pool, pos[pool]))
        pos[pool] += 1
    return EnginePlan(layout, tuple(slots), tuple(group_pools))


def layout_for_model(model_dir: str | Path, block_size: int, device: str = "cpu") -> KVLayout:
    """The layout the connector will derive for a Llama-style model with `layer_types` on
    engines on `device`, read from its config (so a node can be started before the engine)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    layers = tuple(LayerKind.SWA if t == "sliding_attention" else LayerKind.FULL for t in types)
    heads = cfg["num_attention_heads"]
    return KVLayout(
        layers=layers,
        kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        page_size=block_size,
        window=cfg.get("sliding_window") or 0 if LayerKind.SWA in layers else 0,
        dtype=cfg.get("torch_dtype", "float32"),
        tag=model_tag(str(model_dir), device),
    )


def _layer_index(name: str) -> tuple[int, str]:
    m = _LAYER_INDEX.search(name)
    return (int(m.group(1)) if m else -1, name)
