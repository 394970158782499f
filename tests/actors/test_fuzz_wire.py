"""Fuzzing the decoders of wire messages (issue #6): KV events and snapshots (and the
index shard fed them), export replies, route tables. Trace files and configs:
tests/deploy/test_fuzz_files.py. (HTTP bodies: tests/deploy/test_openai_api.py.)

Each decoder gets random bytes or structures, and valid encodings with one part of them
replaced, deleted or added (bit flips and truncation for bytes). It must either return
exactly what was encoded or raise its own error type, never KeyError, TypeError or a
msgpack exception, and a rejection must leave the consumer (an index shard, a cache)
as it was. Whether a structure is valid is decided here by an oracle written from the
format's spec, so a decoder that lets a bad field through fails too.

Marked `fuzz`: the profile's example count by default (40 under CI), 10,000 per test with
`KVF_HYPOTHESIS=full .venv/bin/pytest -m fuzz tests`."""
from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any, Callable

import msgpack
import pytest
import torch
from hypothesis import event, given, strategies as st

from kvfabric.actors.index_shard import IndexShardActor
from kvfabric.fabric import (ApplyResult, EventBatch, EventError, ExportGrant, FetchOutcome, GrantError, KVLayout,
                             LeaseTable, MatchRule, NodeCache, PageState, PoolCapacity, PoolName, PoolPages, PrefixIndex,
                             ReadFailed, Route, RouteError, RouteTable, Snapshot, Tier, TierConfig, decode_events,
                             export_prefix, import_prefix)
from kvfabric.fabric.index.routes import MAX_SHARDS
from tests.kvgen import prefix_kv
from tests.fuzzing import FP, KEY, NEAR, RANDOM, U64, _uint, flipped, fuzz, mutated, typed

pytestmark = pytest.mark.fuzz


# --- KV events and snapshots ---------------------------------------------------------------
def event_wire(m: EventBatch | Snapshot) -> list:
    kind, cleared = ("batch", m.cleared) if isinstance(m, EventBatch) else ("snapshot", True)
    return [1, kind, m.node, m.epoch, m.seq, cleared, [[p.key, p.parent, p.depth, p.mask] for p in m.pages],
            m.fingerprint]


def event_ok(m: object) -> bool:
    """The events format: [1, kind, node, epoch, seq, cleared, pages, fingerprint]."""
    if not (type(m) is list and len(m) == 8):
        return False
    v, kind, node, epoch, seq, cleared, pages, fp = m
    snap = kind == "snapshot"
    return (type(v) is int and v == 1 and type(kind) is str and kind in ("batch", "snapshot")
            and type(node) is str and 1 <= len(node) <= 256 and _uint(epoch) and _uint(seq)
            and type(cleared) is bool and (cleared or not snap) and type(fp) is bytes and len(fp) in (0, 16)
            and type(pages) is list and all(
                type(p) is list and len(p) == 4 and all(type(k) is bytes and len(k) == 16 for k in p[:2])
                and _uint(p[2]) and _uint(p[3]) and (1 if snap else 0) <= p[3] <= 15 for p in pages))


def pages(min_mask: int = 0) -> st.SearchStrategy[tuple[PageState, ...]]:
    page = st.builds(PageState, KEY, KEY, U64, st.integers(min_mask, 15))
    return st.lists(page, max_size=6).map(tuple)


NODE = st.text(min_size=1, max_size=256)
FINGERPRINT = st.sampled_from([b"", FP]) | KEY
BATCHES = st.builds(EventBatch, NODE, U64, U64, pages(), st.booleans(), FINGERPRINT)
SNAPSHOTS = st.builds(Snapshot, NODE, U64, U64, pages(1), FINGERPRINT)
MESSAGES = BATCHES | SNAPSHOTS


@fuzz
@given(MESSAGES)
def test_events_round_trip_exactly(msg: EventBatch | Snapshot) -> None:
    assert decode_events(msg.encode()) == msg
    assert decode_events(msg.encode()).encode() == msg.encode()


def _decode_event_or_reject(data: bytes) -> EventBatch | Snapshot | None:
    try:
        out = decode_events(data)
    except EventError:
        return None
    assert decode_events(out.encode()) == out      # whatever passes is a well-formed message
    return out


@fuzz
@given(st.binary(max_size=300) | MESSAGES.map(lambda m: m.encode()).flatmap(flipped))
def test_event_bytes_decode_or_raise_event_error(data: bytes) -> None:
    _decode_event_or_reject(data)


@fuzz
@given(st.one_of(RANDOM, MESSAGES.map(event_wire).flatmap(mutated)))
def test_event_structures_are_accepted_iff_valid(wire: Any) -> None:
    out = _decode_event_or_reject(msgpack.packb(wire))
    event("accepted" if out else "rejected")
    assert (out is not None) == event_ok(wire), wire
    if out is not None:
        assert event_wire(out) == wire


# The index shard (in process, without Ray) fed encoded messages: a rejection changes nothing.
A_KEYS = [bytes([1, i]) * 8 for i in range(4)]
B_KEYS = [bytes([2, i]) * 8 for i in range(4)]
ROOT = b"R" * 16


def _chain(keys: list[bytes], mask: int) -> tuple[PageState, ...]:
    return tuple(PageState(k, keys[i - 1] if i else ROOT, i, mask) for i, k in enumerate(keys))


def loaded_shard() -> Any:
    shard = IndexShardActor.__ray_actor_class__(0, 1, MatchRule(2), FP)
    assert shard.apply(EventBatch("a", 1, 0, _chain(A_KEYS, 1), fingerprint=FP).encode()) == "applied"
    assert shard.apply(EventBatch("b", 1, 0, _chain(B_KEYS[:3], 5), fingerprint=FP).encode()) == "applied"
    return shard


def index_state(index: PrefixIndex) -> tuple:
    return (index.stats(), {n: (index.node_pages(n), index.sync_point(n)) for n in index.nodes()},
            index.lookup(A_KEYS), index.lookup(B_KEYS), [index.page_meta(k) for k in A_KEYS + B_KEYS])


def shard_state(shard: Any) -> tuple:
    """All but the count of rejections."""
    return index_state(shard.index), shard.lookups, shard.load.lookups, dict(shard.load.regions)


# What a shard may be sent next: a's next batch, b's snapshot, a new node's first batch.
NEXT = [EventBatch("a", 1, 1, _chain(A_KEYS[:2], 3), fingerprint=FP),
        Snapshot("b", 1, 1, _chain(B_KEYS, 5), FP),
        EventBatch("c", 0, 0, _chain(B_KEYS[:2], 1), cleared=True, fingerprint=FP)]


@fuzz
@given(st.sampled_from(NEXT).flatmap(lambda m: st.tuples(
    st.just(m), st.one_of(flipped(m.encode()), st.one_of(mutated(event_wire(m)), mutated(
        event_wire(m), typed, ops=("replace",))).map(msgpack.packb)))))
def test_index_shard_rejections_change_nothing(case: tuple[EventBatch | Snapshot, bytes]) -> None:
    msg, data = case
    shard = loaded_shard()
    before = shard_state(shard)
    answer = (shard.apply if isinstance(msg, EventBatch) else shard.load_snapshot)(data)
    event(answer)
    out = _decode_event_or_reject(data)
    if out is None or type(out) is not type(msg) or out.fingerprint != FP:
        assert answer == "rejected"            # of another layout (or none): refused too
    if answer == "rejected":
        assert shard_state(shard) == before and shard.rejected == 1
    else:
        assert answer in {r.value for r in ApplyResult}


def with_page_field(m: EventBatch | Snapshot, i: int, field: str, value: object) -> EventBatch | Snapshot:
    """`m` of this layout, with one field of page i (mod the page count) set to `value`."""
    ps = list(m.pages)
    i %= len(ps)
    ps[i] = dataclasses.replace(ps[i], **{field: value})
    return dataclasses.replace(m, pages=tuple(ps), fingerprint=FP)


@fuzz
@given(st.one_of(MESSAGES, st.builds(with_page_field, MESSAGES.filter(lambda m: m.pages), st.integers(0, 5),
                                     st.sampled_from(["key", "parent", "depth", "mask"]), NEAR)))
def test_prefix_index_checks_messages_built_in_process(msg: EventBatch | Snapshot) -> None:
    """PrefixIndex.apply/load_snapshot take objects, not bytes: they check them again."""
    index = loaded_shard().index
    before = index_state(index)
    valid = event_ok(event_wire(msg)) and msg.fingerprint == FP
    try:
        (index.apply if isinstance(msg, EventBatch) else index.load_snapshot)(msg)
    except EventError:
        assert not valid and index_state(index) == before
        return
    assert valid


@fuzz
@given(st.binary(max_size=80) | st.lists(st.sampled_from(A_KEYS + B_KEYS), max_size=5).map(b"".join),
       st.integers(-2, 2) | NEAR, st.integers(-2, 6) | NEAR)
def test_index_shard_lookup_checks_its_arguments(keys: bytes, route_version: Any, depth: Any) -> None:
    shard = loaded_shard()
    before = shard_state(shard)
    try:
        found = shard.lookup(keys, route_version, depth)
    except ValueError:
        assert shard_state(shard) == before
        return
    assert type(route_version) is int and type(depth) is int
    assert found is None or all(isinstance(n, str) and type(p) is int for n, p, _ in found)


# --- export replies (grants) -----------------------------------------------------------------
GRANT_FIELDS = {"v", "lease", "fp", "pages", "keys", "pools"}


def grant_ok(m: object) -> bool:
    """{v: 1, lease, fp (16 bytes), pages, keys (one per page), pools: [[pool, first, tiers,
    indices, checksums]]}, each pool once, its pages within [0, pages)."""
    if not (type(m) is dict and set(m) == GRANT_FIELDS):
        return False
    pages, keys, pools = m["pages"], m["keys"], m["pools"]
    if not (type(m["v"]) is int and m["v"] == 1 and _uint(m["lease"]) and _uint(pages)
            and type(m["fp"]) is bytes and len(m["fp"]) == 16 and type(keys) is list and len(keys) == pages
            and all(type(k) is bytes and len(k) == 16 for k in keys) and type(pools) is list):
        return False
    seen = set()
    for e in pools:
        if not (type(e) is list and len(e) == 5 and type(e[0]) is int and e[0] in (0, 1) and e[0] not in seen):
            return False
        seen.add(e[0])
        _, first, tiers, indices, sums = e
        if not (_uint(first) and type(tiers) is list and type(indices) is list and type(sums) is list
                and len(tiers) == len(indices) == len(sums) and first + len(indices) <= pages
                and all(type(t) is int and t in (0, 1) for t in tiers) and all(map(_uint, indices))
                and all(type(s) is int for s in sums)):
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
    return ExportGrant(draw(U64), draw(st.just(FP) | KEY), n,
                       tuple(draw(st.lists(KEY, min_size=n, max_size=n))), pools)


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
@given(st.one_of(RANDOM, grants().map(grant_wire).flatmap(lambda w: mutated(w, new_keys=st.sampled_from(
    sorted(GRANT_FIELDS) + ["x"])))))
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
    return NodeCache(LAYOUT, {PoolName.FULL: PoolCapacity(16, 16), PoolName.SWA: PoolCapacity(8, 8)},
                     tier=TierConfig(policy="write_back"), device="cpu")


@cache
def source_and_grants() -> tuple[NodeCache, dict[int, ExportGrant]]:
    src = new_cache()
    src.put(TOKENS, prefix_kv(LAYOUT, TOKENS), NS)
    leases = LeaseTable(src)
    keys = src.keys(TOKENS, NS)
    return src, {skip: export_prefix(src, leases, keys, skip, 60.0) for skip in (0, 2)}


def page_reader(src: NodeCache, dst: NodeCache) -> Callable:
    def read(pool: PoolName, refs: list[tuple[Tier, int]], pages: list[int]) -> None:
        for tier, index in refs:     # what the transport checks against the peer's registration
            if not 0 <= index < src.registry.pool(pool, tier).data.shape[0]:
                raise ReadFailed(f"page {index} is outside the peer's {pool.name}/{tier.name} pool")
        for (tier, index), page in zip(refs, pages):
            dst.registry.pool(pool, Tier.DEVICE).data[page] = src.registry.pool(pool, tier).data[index]
    return read


@fuzz
@given(st.sampled_from([0, 2]), st.data(), st.sampled_from([NS, NS, "intruder"]))
def test_import_with_a_mutated_grant_commits_the_right_pages_or_changes_nothing(
        held: int, data: st.DataObject, namespace: str) -> None:
    src, exported = source_and_grants()
    wire = grant_wire(exported[held])
    wire = data.draw(mutated(wire, new_keys=st.sampled_from(sorted(GRANT_FIELDS)))
                     | mutated(wire, typed, ops=("replace",)))
    try:
        grant = ExportGrant.decode(msgpack.packb(wire))
    except GrantError:
        assert not grant_ok(wire)
        return
    dst = new_cache()
    if held:
        dst.put(TOKENS[:held * LAYOUT.page_size], prefix_kv(LAYOUT, TOKENS[:held * LAYOUT.page_size]), NS)
    before = dst.snapshot()
    outcome = import_prefix(dst, TOKENS, namespace, grant, page_reader(src, dst))
    event(outcome.value)
    dst.check()
    if grant.fingerprint != LAYOUT.fingerprint or (namespace != NS and grant.pages):
        assert outcome == FetchOutcome.BAD_GRANT
    if outcome != FetchOutcome.COMMITTED:
        assert dst.snapshot() == before
        return
    hit = dst.get(TOKENS, NS)                 # what was committed is the source's K/V
    want = prefix_kv(LAYOUT, TOKENS[:hit.tokens])
    assert hit.tokens == grant.pages * LAYOUT.page_size
    for i, kind in enumerate(LAYOUT.layers):
        start = 0 if kind.value == "full" else hit.starts[PoolName.SWA]
        assert torch.equal(hit.layers[i], want[i][:, start:hit.tokens])


# --- route tables ---------------------------------------------------------------------------
def routes_ok(m: object) -> bool:
    """[1, version, shards, [[path of 16-byte keys, shard, spread]]], one route per last key."""
    if not (type(m) is list and len(m) == 4):
        return False
    v, version, shards, routes = m
    if not (type(v) is int and v == 1 and _uint(version) and type(shards) is int
            and 1 <= shards <= MAX_SHARDS and type(routes) is list):
        return False
    last = set()
    for r in routes:
        if not (type(r) is list and len(r) == 3 and type(r[0]) is list and r[0]
                and all(type(k) is bytes and len(k) == 16 for k in r[0])
                and type(r[1]) is int and 0 <= r[1] < shards and type(r[2]) is bool and r[0][-1] not in last):
            return False
        last.add(r[0][-1])
    return True


@st.composite
def route_tables(draw: st.DrawFn) -> RouteTable:
    shards = draw(st.integers(1, 8) | st.just(MAX_SHARDS))
    ends = draw(st.lists(KEY, unique=True, max_size=5))
    routes = [Route((*draw(st.lists(KEY, max_size=3)), end), draw(st.integers(0, shards - 1)), draw(st.booleans()))
              for end in ends]
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


@pytest.mark.parametrize("wire", [[1, 0, True, []], [1, True, 2, []], [True, 0, 2, []], [1, 0, 2, [[[b"k" * 16], True, False]]],
                                  [1, 0, MAX_SHARDS + 1, []], [1, 0, 2**40, [[[b"k" * 16], 0, True]]]])
def test_route_tables_that_passed(wire: list) -> None:
    with pytest.raises(RouteError):
        RouteTable.decode(msgpack.packb(wire))


def test_messages_that_passed() -> None:
    for wire in ([True, "batch", "n", 0, 0, False, [], b""], [1, "snapshot", "n", 0, 0, False, [], b""]):
        with pytest.raises(EventError):
            decode_events(msgpack.packb(wire))
    good = grant_wire(ExportGrant(0, FP, 0, ()))
    for bad in ({"fp": b"short"}, {"v": True}, {"pools": [5]}, {"pools": [[2, 0, [], [], []]]}):
        with pytest.raises(GrantError):
            ExportGrant.from_wire(good | bad)

