"""What the ingress sends the model servers, and what they answer.

Plain dataclasses: they cross Ray's object store between the HTTP ingress,
the request router (which reads `tokens` and `namespace` to route) and the
model-server replicas. The ingress validates HTTP bodies before building one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True)
class GenerateRequest:
    tokens: tuple[int, ...]  # prompt token ids, validated against the model's vocab
    max_tokens: int
    namespace: str  # its cache namespace (cache_namespace.py): pages never match across them
    use_cache: bool = True  # False: neither read nor fill any cache (the baseline)
    arrival_s: float = 0.0  # time.time() when the ingress received it (for TTFT)
    logits_digest: bool = False  # answer GenerateResult.logits_digest (costs every step's logits)


class PrefixFetch(str, Enum):
    """What a request did about a longer prefix held on another node."""

    NONE = "none"  # no fabric, or no node holds more than this one
    SKIPPED = "skipped"  # one did, but recomputing was cheaper than moving it
    FETCHED = "fetched"
    FAILED = "failed"  # tried; the request computed instead


@dataclass(frozen=True)
class GenerateResult:
    tokens: list[int]  # generated ids
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from a cache
    device_tokens: int
    host_tokens: int
    remote_tokens: int
    fetch: PrefixFetch
    ttft_s: float  # arrival at the ingress to the first token
    node: str  # the node actor whose cache served it
    logits_digest: str = ""  # hash of every step's logits, when asked: equal outputs, bit for bit
    retries: int = 0  # replicas that died under it before this one answered
    fetched_bytes: int = 0  # KV bytes its remote fetch moved (the engine's count: PageBytes.fetch)
    extra: dict = field(default_factory=dict)
