"""check(): each invariant a corrupted cache breaks is named in its error."""

import pytest
from kvfabric.core.cache.check import InvariantError
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.radix import ABSENT

from tests.core.test_node_cache import NS, make, put, seq


def test_checker_names_violations():
    cache = make()
    put(cache, seq(3))
    cache.registry.pool(PoolName.FULL, Tier.DEVICE).allocator.alloc(1)
    with pytest.raises(InvariantError, match="owned by nobody"):
        cache.check()
    cache = make()
    put(cache, seq(3))
    pages = cache.match(seq(3), NS).path[0].slots[Tier.DEVICE][PoolName.FULL]
    pages[1] = pages[0]
    with pytest.raises(InvariantError, match="owned twice"):
        cache.check()
    cache = make()
    put(cache, seq(3))
    cache.match(seq(3), NS).path[0].locks[PoolName.FULL] = -1
    with pytest.raises(InvariantError, match="negative"):
        cache.check()


def test_checker_names_the_full_attention_rules():
    """The rules only full attention has (the policy's node_fault), each named."""

    def broken(corrupt) -> InvariantError:
        cache = make()
        put(cache, seq(2))
        put(cache, seq(4))  # a child run under the first
        parent, child = cache.match(seq(4), NS).path
        corrupt(parent, child)
        with pytest.raises(InvariantError) as e:
            cache.check()
        return e.value

    def tombstone(parent, child):
        child.slots[Tier.DEVICE][PoolName.FULL][0] = ABSENT

    def no_full(parent, child):
        child.slots[Tier.DEVICE][PoolName.FULL] = child.slots[Tier.HOST][PoolName.FULL] = None

    def locks(parent, child):
        child.locks[PoolName.FULL] += 1

    assert "only part of its run" in str(broken(tombstone))
    assert "prefix closure" in str(broken(no_full))
    assert "more full locks than its parent" in str(broken(locks))
