"""A vLLM request's namespace in the fabric, from its cache_salt: one rule for the
connector (what it stores and loads) and the KV-event feed (what the index says the
engine holds), so both name a page by the same key."""
from __future__ import annotations

DEFAULT = "default"


def fabric_namespace(cache_salt: str | None) -> str:
    # Tenants never share: a request's cache_salt is its namespace in the fabric.
    return cache_salt or DEFAULT
