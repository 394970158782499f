"""A vLLM request's namespace in the fabric, from its cache_salt: one rule for the
connector (what it stores and loads) and the KV-event feed (what the index says the
engine holds), so both name a page by the same key."""

from __future__ import annotations

DEFAULT = "default"
SALTED = "salt/"


def fabric_namespace(cache_salt: str | None) -> str:
    """Tenants never share: each cache_salt is a namespace of its own, apart from the
    unsalted one (vLLM hashes a salt of "default" apart from no salt, and so must we)."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
    # vLLM treats an empty salt as none (it adds no extra key to the first block).
    return SALTED + cache_salt if cache_salt else DEFAULT
