"""Checks the engine tests share: equal outputs bit for bit, and no poisoned page."""

from __future__ import annotations

import torch
from kvfabric.core.cache.layout import Tier
from kvfabric.core.cache.node_cache import NodeCache


def assert_same(got, want) -> None:
    """Same tokens and every step's logits equal, bit for bit."""
    assert got.tokens == want.tokens
    assert len(got.logits) == len(want.logits)
    for a, b in zip(got.logits, want.logits):
        assert torch.equal(a, b)


def assert_no_nan(c: NodeCache) -> None:
    """No stored page may hold NaN (a put once padded the SWA rows a state lacked with NaN)."""
    for entry in c.registry:
        for tier in (Tier.DEVICE, Tier.HOST):  # the tiers with tensors
            data = entry.tier(tier).data
            assert not torch.isnan(data).any(), f"{entry.name.name}/{tier.name} holds NaN"
