"""Deterministic K/V for tests: the demo's stand-in model (a token's K/V depends on its prefix)."""
from deploy.demo import stand_in_kv as prefix_kv

__all__ = ["prefix_kv"]
