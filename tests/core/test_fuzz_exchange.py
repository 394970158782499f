"""Fuzzing the decoders of wire messages (issue #6), part two: export replies (grants) and
route tables. KV events and the index shard: tests/actors/test_fuzz_events.py.

How the decoders are fuzzed, and the `fuzz` mark: tests/fuzzing.py."""

from __future__ import annotations

from functools import cache
from typing import Any, Callable

import msgpack
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from kvfabric.core.cache.layout import KVLayout, PoolName, Tier
from kvfabric.core.cache.leases import LeaseTable
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig
from kvfabric.core.exchange.destination import FetchOutcome, ReadFailed, import_prefix
from kvfabric.core.exchange.grant import ExportGrant, GrantError, PoolPages
from kvfabric.core.exchange.source import export_prefix
from kvfabric.core.index.events import EventError
from kvfabric.core.index.events import decode as decode_events
from kvfabric.core.index.routes import MAX_SHARDS, Route, RouteError, RouteTable

from tests.fuzzing import FP, KEY, RANDOM, U64, _uint, flipped, fuzz, mutated, typed
from tests.kvgen import prefix_kv

pytestmark = pytest.mark.fuzz


# --- export replies (grants) -----------------------------------------------------------------
GRANT_FIELDS = {"v", "lease", "fp", "pages", "keys", "pools"}


def grant_ok(m: object) -> bool:
    """{v: 1, lease, fp (16 bytes), pages, keys (one per page), pools: [[pool, first, tiers,
    indices, checksums]]}, each pool once, its pages within [0, pages)."""
    if not (type(m) is dict and set(m) == GRANT_FIELDS):
        return False
    pages, keys, pools = m["pages"], m["keys"], m["pools"]
    if not (
        type(m["v"]) is int
        and m["v"] == 1
        and _uint(m["lease"])
        and _uint(pages)
        and type(m["fp"]) is bytes
        and len(m["fp"]) == 16
        and type(keys) is list
        and len(keys) == pages
        and all(type(k) is bytes and len(k) == 16 for k in keys)
        and type(pools) is list
    ):
        return False
    seen = set()
    for e in pools:
        if not (
            type(e) is list
            and len(e) == 5
            and type(e[0]) is int
            and e[0] in (0, 1)
            and e[0] not in seen
        ):
            return False
        seen.add(e[0])
        _, first, tiers, indices, sums = e
        if not (
            _uint(first)
            and type(tiers) is list
            and type(indices) is list
            and type(sums) is list
            and len(tiers) == len(indices) == len(sums)
            and first + len(indices) <= pages
            and all(type(t) is int and t in (0, 1) for t in tiers)
            and all(map(_uint, indices))
            and all(type(s) is int for s in sums)
        ):
            return False
    return True


@st.composite
def grants(draw: st.DrawFn) -> ExportGrant:
    n = draw(st.integers(0, 6))
    pools = {}
    for pool in draw(st.lists(st.sampled_from(PoolName), unique=True)):
        first = draw(st.integers(0, n))
        k = draw(st.integers(0, n - first))
        ints = st.lists(U64, min_size=k, max_size=k).map(tuple)
        tiers = st.lists(st.sampled_from([0, 1]), min_size=k, max_size=k).map(tuple)
        pools[pool] = PoolPages(first, draw(tiers), draw(ints), draw(ints))
    return ExportGrant(
        draw(U64),
        draw(st.just(FP) | KEY),
        n,
        tuple(draw(st.lists(KEY, min_size=n, max_size=n))),
        pools,
    )


def grant_wire(g: ExportGrant) -> dict:
    return msgpack.unpackb(g.encode())


@fuzz
@given(grants())
def test_grants_round_trip_exactly(grant: ExportGrant) -> None:
    assert ExportGrant.decode(grant.encode()) == grant
    assert ExportGrant.from_wire(grant.to_wire()) == grant


@fuzz
@given(st.binary(max_size=200) | grants().map(ExportGrant.encode).flatmap(flipped))
def test_grant_bytes_decode_or_raise_grant_error(data: bytes) -> None:
    try:
        grant = ExportGrant.decode(data)
    except GrantError:
        return
    assert ExportGrant.decode(grant.encode()) == grant


@fuzz
@given(
    st.one_of(
        RANDOM,
        grants()
        .map(grant_wire)
        .flatmap(lambda w: mutated(w, new_keys=st.sampled_from(sorted(GRANT_FIELDS) + ["x"]))),
    )
)
def test_grant_structures_are_accepted_iff_valid(wire: Any) -> None:
    try:
        grant = ExportGrant.decode(msgpack.packb(wire))
    except GrantError:
        assert not grant_ok(wire), wire
        return
    assert grant_ok(wire) and grant_wire(grant) == wire


# A fetch of 6 pages into a cache holding 0 or 2 of them, with the grant mutated on the wire.
LAYOUT = KVLayout(layers=("full", "swa", "full"), kv_heads=2, head_dim=4, page_size=4, window=8)
NS = "tenant"
TOKENS = list(range(6 * LAYOUT.page_size))


def new_cache() -> NodeCache:
    return NodeCache(
        LAYOUT,
        {PoolName.FULL: PoolCapacity(16, 16), PoolName.SWA: PoolCapacity(8, 8)},
        tier=TierConfig(policy="write_back"),
        device="cpu",
    )


@cache
def source_and_grants() -> tuple[NodeCache, dict[int, ExportGrant]]:
    src = new_cache()
    src.put(TOKENS, prefix_kv(LAYOUT, TOKENS), NS)
    leases = LeaseTable(src)
    keys = src.keys(TOKENS, NS)
    return src, {skip: export_prefix(src, leases, keys, skip, 60.0) for skip in (0, 2)}


def page_reader(src: NodeCache, dst: NodeCache) -> Callable:
    def read(pool: PoolName, refs: list[tuple[Tier, int]], pages: list[int]) -> None:
        for tier, index in refs:  # what the transport checks against the peer's registration
            if not 0 <= index < src.registry.pool(pool, tier).data.shape[0]:
                raise ReadFailed(f"page {index} is outside the peer's {pool.name}/{tier.name} pool")
        for (tier, index), page in zip(refs, pages):
            dst.registry.pool(pool, Tier.DEVICE).data[page] = src.registry.pool(pool, tier).data[
                index
            ]

    return read


@fuzz
@given(st.sampled_from([0, 2]), st.data(), st.sampled_from([NS, NS, "intruder"]))
def test_import_with_a_mutated_grant_commits_the_right_pages_or_changes_nothing(
    held: int, data: st.DataObject, namespace: str
) -> None:
    src, exported = source_and_grants()
    wire = grant_wire(exported[held])
    wire = data.draw(
        mutated(wire, new_keys=st.sampled_from(sorted(GRANT_FIELDS)))
        | mutated(wire, typed, ops=("replace",))
    )
    try:
        grant = ExportGrant.decode(msgpack.packb(wire))
    except GrantError:
        assert not grant_ok(wire)
        return
    dst = new_cache()
    if held:
        dst.put(
            TOKENS[: held * LAYOUT.page_size],
            prefix_kv(LAYOUT, TOKENS[: held * LAYOUT.page_size]),
            NS,
        )
    before = dst.snapshot()
    outcome = import_prefix(dst, TOKENS, namespace, grant, page_reader(src, dst))
    event(outcome.value)
    dst.check()
    if grant.fingerprint != LAYOUT.fingerprint or (namespace != NS and grant.pages):
        assert outcome == FetchOutcome.BAD_GRANT
    if outcome != FetchOutcome.COMMITTED:
        assert dst.snapshot() == before
        return
    hit = dst.get(TOKENS, NS)  # what was committed is the source's K/V
    want = prefix_kv(LAYOUT, TOKENS[: hit.tokens])
    assert hit.tokens == grant.pages * LAYOUT.page_size
    for i, kind in enumerate(LAYOUT.layers):
        start = 0 if kind.value == "full" else hit.starts[PoolName.SWA]
        assert torch.equal(hit.layers[i], want[i][:, start : hit.tokens])


# --- route tables ---------------------------------------------------------------------------
def routes_ok(m: object) -> bool:
    """[1, version, shards, [[path of 16-byte keys, shard, spread]]], one route per last key."""
    if not (type(m) is list and len(m) == 4):
        return False
    v, version, shards, routes = m
    if not (
        type(v) is int
        and v == 1
        and _uint(version)
        and type(shards) is int
        and 1 <= shards <= MAX_SHARDS
        and type(routes) is list
    ):
        return False
    last = set()
    for r in routes:
        if not (
            type(r) is list
            and len(r) == 3
            and type(r[0]) is list
            and r[0]
            and all(type(k) is bytes and len(k) == 16 for k in r[0])
            and type(r[1]) is int
            and 0 <= r[1] < shards
            and type(r[2]) is bool
            and r[0][-1] not in last
        ):
            return False
        last.add(r[0][-1])
    return True


@st.composite
def route_tables(draw: st.DrawFn) -> RouteTable:
    shards = draw(st.integers(1, 8) | st.just(MAX_SHARDS))
    ends = draw(st.lists(KEY, unique=True, max_size=5))
    routes = [
        Route(
            (*draw(st.lists(KEY, max_size=3)), end),
            draw(st.integers(0, shards - 1)),
            draw(st.booleans()),
        )
        for end in ends
    ]
    return RouteTable(shards, routes, draw(U64))


def routes_wire(t: RouteTable) -> list:
    return [1, t.version, t.shards, [[list(r.path), r.shard, r.spread] for r in t.routes]]


@fuzz
@given(route_tables())
def test_route_tables_round_trip_exactly(table: RouteTable) -> None:
    out = RouteTable.decode(table.encode())
    assert routes_wire(out) == routes_wire(table) and out.encode() == table.encode()
    for r in table.routes:
        assert out.shards_for(r.path) == table.shards_for(r.path)


@fuzz
@given(st.binary(max_size=200) | route_tables().map(RouteTable.encode).flatmap(flipped))
def test_route_bytes_decode_or_raise_route_error(data: bytes) -> None:
    try:
        table = RouteTable.decode(data)
    except RouteError:
        return
    assert routes_wire(RouteTable.decode(table.encode())) == routes_wire(table)


@fuzz
@given(st.one_of(RANDOM, route_tables().map(routes_wire).flatmap(mutated)))
def test_route_structures_are_accepted_iff_valid(wire: Any) -> None:
    try:
        table = RouteTable.decode(msgpack.packb(wire))
    except RouteError:
        assert not routes_ok(wire), wire
        return
    assert routes_ok(wire) and routes_wire(table) == wire


@pytest.mark.parametrize(
    "wire",
    [
        [1, 0, True, []],
        [1, True, 2, []],
        [True, 0, 2, []],
        [1, 0, 2, [[[b"k" * 16], True, False]]],
        [1, 0, MAX_SHARDS + 1, []],
        [1, 0, 2**40, [[[b"k" * 16], 0, True]]],
    ],
)
def test_route_tables_that_passed(wire: list) -> None:
    with pytest.raises(RouteError):
        RouteTable.decode(msgpack.packb(wire))


def test_messages_that_passed() -> None:
    for wire in (
        [True, "batch", "n", 0, 0, False, [], b""],
        [1, "snapshot", "n", 0, 0, False, [], b""],
    ):
        with pytest.raises(EventError):
            decode_events(msgpack.packb(wire))
    good = grant_wire(ExportGrant(0, FP, 0, ()))
    for bad in ({"fp": b"short"}, {"v": True}, {"pools": [5]}, {"pools": [[2, 0, [], [], []]]}):
        with pytest.raises(GrantError):
            ExportGrant.from_wire(good | bad)
