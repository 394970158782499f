"""Model KV layout: which layers are full or sliding-window, and page geometry."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum, IntEnum
from functools import cache, cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a layout names its dtype; only pools and copies need torch's
    import torch


class LayerKind(str, Enum):
    FULL = "full"
    SWA = "swa"


class PoolName(IntEnum):
    """A pool holds one page of K/V for every layer of one attention kind."""

    FULL = 0
    SWA = 1


class Tier(IntEnum):
    """Where a page's bytes lie, fastest first: a page moves down a tier when evicted
    (where the next tier exists) and back up to device before use."""

    DEVICE = 0
    HOST = 1
    DISK = 2


_POOL_OF_KIND = {LayerKind.FULL: PoolName.FULL, LayerKind.SWA: PoolName.SWA}
_KINDS = frozenset(k.value for k in LayerKind)
# Element types of a page, by torch's name, and their bytes: index processes use layouts
# but never import torch (seconds of CPU at start and ~300 MB). uint8 holds fp8 KV as
# engines store it (vLLM's fp8 caches are byte tensors; which fp8 format and its scales
# belong in the layout's tag).
_DTYPES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
# A tag made of `name=value` parts joined by TAG_SEP names each part in `differences`.
TAG_SEP = ";"


@cache  # read on every put's check: torch imported, and the name looked up, once
def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class KVLayout:
    """Geometry of a model's KV cache.

    A page of a pool holds K and V of every layer of that pool's kind for
    `page_size` tokens: shape [layers_in_pool, 2, page_size, kv_heads, head_dim].
    """

    layers: tuple[LayerKind, ...]
    kv_heads: int
    head_dim: int
    page_size: int
    window: int = 0  # sliding window in tokens, used by SWA layers
    dtype: str = "float32"
    # What else makes two caches' bytes incompatible: an engine's model, dtypes, kernel
    # (deploy/vllm/connector/kv_identity.py writes `name=value` parts joined by ";", so that
    # `differences` can name the part that differs). Empty for the fabric's own engine.
    tag: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.layers, (tuple, list)) or not all(
            isinstance(k, LayerKind) or (isinstance(k, str) and k in _KINDS) for k in self.layers
        ):
            raise LayoutError(f"layers must be a sequence of {sorted(_KINDS)}, got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(LayerKind(k) for k in self.layers))
        if not self.layers:
            raise LayoutError("layout needs at least one layer")
        for name in ("kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, str) or self.dtype not in _DTYPES:
            raise LayoutError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.tag, str):
            raise LayoutError(f"tag must be a str, got {self.tag!r}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise LayoutError(f"window must be an int >= 0, got {self.window!r}")
        has_swa = LayerKind.SWA in self.layers
        if has_swa and self.window <= 0:
            raise LayoutError(f"SWA layers need a positive window, got {self.window!r}")
        if not has_swa and self.window:
            raise LayoutError("window is set but the layout has no SWA layers")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _torch_dtype(self.dtype)

    @cached_property  # read on every put: computed once (fields are frozen)
    def pools(self) -> tuple[PoolName, ...]:
        """The pools of this layout, FULL first: the first is the one whose pages keep a
        tree node alive (NodeCache.primary_pool)."""
        present = {_POOL_OF_KIND[k] for k in self.layers}
        return tuple(sorted(present))

    def layers_of(self, pool: PoolName) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layers) if _POOL_OF_KIND[k] == pool)

    def page_shape(self, pool: PoolName) -> tuple[int, ...]:
        return (len(self.layers_of(pool)), 2, self.page_size, self.kv_heads, self.head_dim)

    def page_bytes(self, pool: PoolName) -> int:
        n = 1
        for d in self.page_shape(pool):
            n *= d
        return n * _DTYPES[self.dtype]

    @property
    def window_pages(self) -> int:
        """Pages that cover the last `window` tokens before a page boundary."""
        return -(-self.window // self.page_size) if self.window else 0

    @property
    def fingerprint(self) -> bytes:
        text = "|".join(
            [
                ",".join(k.value for k in self.layers),
                str(self.kv_heads),
                str(self.head_dim),
                str(self.page_size),
                str(self.window),
                self.dtype,
            ]
            + ([self.tag] if self.tag else [])
        )
        return hashlib.blake2b(text.encode(), digest_size=16, person=b"kvf-layout").digest()

    def differences(self, other: "KVLayout") -> list[str]:
        """What differs between two layouts, each as `name: ours vs theirs` (a tag's
        `name=value` parts one by one); empty when the fingerprints are equal."""
        if self.fingerprint == other.fingerprint:
            return []
        out = [
            f"{name}: {mine!r} vs {theirs!r}"
            for name, mine, theirs in (
                (n, getattr(self, n), getattr(other, n))
                for n in ("layers", "kv_heads", "head_dim", "page_size", "window", "dtype")
            )
            if mine != theirs
        ]
        mine_parts, their_parts = _tag_parts(self.tag), _tag_parts(other.tag)
        for name in sorted(set(mine_parts) | set(their_parts)):
            mine, theirs = mine_parts.get(name), their_parts.get(name)
            if mine != theirs:
                out.append(f"tag {name}: {mine!r} vs {theirs!r}")
        return out

    def to_dict(self) -> dict:
        d = {
            "layers": [k.value for k in self.layers],
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size,
            "window": self.window,
            "dtype": self.dtype,
        }
        if self.tag:
            d["tag"] = self.tag
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        if not isinstance(d, dict):
            raise LayoutError(f"layout must be a mapping, got {type(d).__name__}")
        unknown = set(d) - {"layers", "kv_heads", "head_dim", "page_size", "window", "dtype", "tag"}
        if unknown:
            raise LayoutError(f"unknown layout fields: {sorted(map(repr, unknown))}")
        if not isinstance(d.get("layers"), (list, tuple)):
            raise LayoutError(f"layers must be a list, got {d.get('layers')!r}")
        try:
            return cls(
                layers=tuple(d["layers"]),
                kv_heads=d["kv_heads"],
                head_dim=d["head_dim"],
                page_size=d["page_size"],
                window=d.get("window", 0),
                dtype=d.get("dtype", "float32"),
                tag=d.get("tag", ""),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LayoutError(f"bad layout: {e}") from e


def _tag_parts(tag: str) -> dict[str, str]:
    """A tag's `name=value` parts; a part without "=" is named by its position."""
    parts: dict[str, str] = {}
    for i, part in enumerate(tag.split(TAG_SEP) if tag else []):
        name, eq, value = part.partition("=")
        parts[name if eq else f"#{i}"] = value if eq else part
    return parts
