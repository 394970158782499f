"""EnginePages (deploy/vllm/events/engine_pages.py): vLLM's block events as the fabric
index's pages.

The property test plays an engine: requests compute block ranges of prompts (every
group stores them, sliding-window groups only the last window, the groups' events in
any order), blocks leave groups one at a time, the cache is cleared. The translated
batches go into a real PrefixIndex; its pages for the engine must equal a model of
what the engine holds: every block some group holds, keyed by the fabric's own keyer
under the request's namespace, masked by which groups hold it."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.cache.keys import PageKeyer
from kvfabric.core.cache.layout import KVLayout, LayerKind, PoolName
from kvfabric.core.index.events import PageMask, PageState
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.prefix_index import PrefixIndex
from kvfabric.core.index.routes import RouteTable
from kvfabric.deploy.serving.cache_namespace import cache_namespace
from kvfabric.deploy.vllm.events.engine_pages import EnginePages, Skip
from kvfabric.deploy.vllm.events.event_wire import AllBlocksCleared, BlockRemoved, BlockStored

PS = 4
LAYOUT = KVLayout(
    layers=(LayerKind.SWA, LayerKind.FULL, LayerKind.SWA),
    kv_heads=1,
    head_dim=4,
    page_size=PS,
    window=8,
    dtype="float32",
    tag="test",
)
GROUPS = (PoolName.SWA, PoolName.FULL, PoolName.SWA)  # two sliding-window groups, one full
WINDOW_BLOCKS = 2
NODE = "node-0/engine/0"


def vllm_hash(salt: str | None, tokens: tuple[int, ...]) -> bytes:
    """A stand-in for vLLM's chained block hash: over the salt and the whole prefix."""
    return hashlib.sha256(repr((salt, tokens)).encode()).digest()


class Engine:
    """The model: which (block hash, group) the engine holds, and each hash's prompt prefix."""

    def __init__(self) -> None:
        self.held: set[tuple[bytes, int]] = set()
        self.prefix: dict[bytes, tuple[str | None, tuple[int, ...]]] = {}

    def compute(
        self, salt: str | None, tokens: tuple[int, ...], first: int, end: int, order: list[int]
    ) -> list[BlockStored]:
        hashes = [vllm_hash(salt, tokens[: (b + 1) * PS]) for b in range(end)]
        for b in range(end):
            self.prefix[hashes[b]] = (salt, tokens[: (b + 1) * PS])
        events = []
        for g in order:
            lo = first if GROUPS[g] == PoolName.FULL else max(first, end - WINDOW_BLOCKS)
            for b in range(lo, end):
                self.held.add((hashes[b], g))
            # As vLLM writes them: a window group lists its in-window hashes only, with the
            # parent and the tokens of the whole range.
            extra = [([salt] if salt and b == 0 else None) for b in range(lo, end)]
            events.append(
                BlockStored(
                    tuple(hashes[lo:end]),
                    hashes[first - 1] if first else None,
                    tokens[first * PS : end * PS],
                    PS,
                    "GPU",
                    g,
                    None,
                    None,
                    None,
                    None,
                    tuple(None if e is None else tuple(e) for e in extra),
                )
            )
        return events

    def expected(self) -> dict[bytes, PageState]:
        out, by_hash = {}, {}
        for h, g in self.held:
            by_hash.setdefault(h, set()).add(g)
        for h, groups in by_hash.items():
            mask = (PageMask.FULL_DEVICE if 1 in groups else 0) | (
                PageMask.SWA_DEVICE if {0, 2} <= groups else 0
            )
            if not mask:
                continue
            salt, tokens = self.prefix[h]
            keys = PageKeyer(cache_namespace(salt), LAYOUT.fingerprint, PS).keys(tokens)
            parent = (
                keys[-2]
                if len(keys) > 1
                else PageKeyer(cache_namespace(salt), LAYOUT.fingerprint, PS).root
            )
            out[keys[-1]] = PageState(keys[-1], parent, len(keys) - 1, int(mask))
        return out


PROMPTS = [tuple([1, 2, 3, 4] * 2 + [5] * 16), tuple([1, 2, 3, 4] * 2 + [6] * 16), tuple(range(24))]
SALTS = [None, "tenant-a", "tenant-b"]
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("compute"),
            st.sampled_from(SALTS),
            st.integers(0, len(PROMPTS) - 1),
            st.integers(0, 6),
            st.integers(1, 6),
            st.permutations(range(len(GROUPS))),
        ),
        st.tuples(st.just("remove"), st.integers(0, 99), st.integers(0, len(GROUPS) - 1)),
        st.tuples(st.just("clear")),
    ),
    max_size=25,
)


def drain_into(pages: EnginePages, index: PrefixIndex, routes: RouteTable) -> None:
    for batch in pages.drain_routed(routes).values():
        assert index.apply(batch).value == "applied"


@given(OPS, st.integers(1, 3))
def test_translated_index_equals_what_the_engine_holds(
    ops: list[tuple], publish_every: int
) -> None:
    engine, pages = Engine(), EnginePages(NODE, 1, LAYOUT, GROUPS)
    index, routes = PrefixIndex(MatchRule.of(LAYOUT), LAYOUT.fingerprint), RouteTable(1)
    computed: dict[tuple[str | None, int], int] = {}  # blocks a request may build on
    for step, op in enumerate(ops):
        if op[0] == "compute":
            _, salt, p, first, n, order = op
            first = min(first, computed.get((salt, p), 0))  # a request extends what it computed
            end = min(first + n, len(PROMPTS[p]) // PS)
            if end <= first:
                continue
            computed[(salt, p)] = max(computed.get((salt, p), 0), end)
            pages.apply(engine.compute(salt, PROMPTS[p], first, end, list(order)))
        elif op[0] == "remove":
            held = sorted(engine.held)
            if not held:
                continue
            h, g = held[op[1] % len(held)]
            engine.held.discard((h, g))
            pages.apply([BlockRemoved((h,), "GPU", g)])
        else:
            engine.held.clear()
            pages.apply([AllBlocksCleared()])
        if step % publish_every == 0:
            drain_into(pages, index, routes)
    drain_into(pages, index, routes)
    assert pages.held() == engine.expected()
    assert index.node_pages(NODE) == engine.expected()


def test_tenants_identical_prompts_never_share_a_page() -> None:
    pages = EnginePages(NODE, 1, LAYOUT, GROUPS)
    tokens = tuple(range(8))
    for salt in (None, "a", "b"):
        pages.apply(Engine().compute(salt, tokens, 0, 2, [0, 1, 2]))
    keys = list(pages.held())
    assert len(keys) == 6 and len(set(keys)) == 6


def test_unsupported_and_unknown_blocks_are_skipped_and_counted() -> None:
    pages = EnginePages(NODE, 1, LAYOUT, GROUPS)
    h = [vllm_hash(None, (i,)) for i in range(4)]
    pages.apply(
        [
            BlockStored(
                (h[0],), h[3], (1,) * PS, PS, "GPU", 1, None, None, None, None, None
            ),  # parent unknown
            BlockStored(
                (h[1],), None, (1,) * PS, PS, "CPU", 1, None, None, None, None, None
            ),  # offload tier
            BlockStored(
                (h[1],), None, (1,) * PS, PS, "GPU", 7, None, None, None, None, None
            ),  # no such group
            BlockStored(
                (h[1],), None, (1,) * PS, PS, None, 1, "sliding_window", 8, None, None, None
            ),  # wrong kind
            BlockStored(
                (h[1],), None, (1,) * 2 * PS, 2 * PS, "GPU", 1, None, None, None, None, None
            ),  # other size
            BlockStored(
                (h[1],), None, (1,) * PS, PS, "GPU", 1, None, None, None, "lora", None
            ),  # LoRA
            BlockStored(
                (h[1],), None, (1,) * PS, PS, "GPU", 1, None, None, None, None, (("mm", 0),)
            ),  # multimodal
            BlockRemoved((h[2],), "GPU", 1),
        ]
    )
    assert pages.held() == {}
    s = pages.stats.skipped
    assert (
        s[Skip.UNKNOWN_PARENT],
        s[Skip.MEDIUM],
        s[Skip.GROUP],
        s[Skip.BLOCK_SIZE],
        s[Skip.EXTRA_KEYS],
        s[Skip.UNKNOWN_REMOVED],
    ) == (1, 1, 2, 1, 2, 1)


@pytest.mark.parametrize("shards", [1, 3])
def test_memory_stays_bounded_with_many_distinct_blocks(shards: int) -> None:
    """Far more distinct blocks than max_entries: entries, keys and the changes waiting
    stay bounded, and what is published is still a subset of what the engine holds."""
    cap = 64
    pages, engine = EnginePages(NODE, 1, LAYOUT, GROUPS, max_entries=cap, max_depth=8), Engine()
    routes = RouteTable(shards)
    indexes = [PrefixIndex(MatchRule.of(LAYOUT), LAYOUT.fingerprint) for _ in range(shards)]
    for i in range(2000):
        tokens = tuple(range(i * 100, i * 100 + 3 * PS))
        pages.apply(engine.compute(f"t{i % 7}", tokens, 0, 3, [1, 0, 2]))
        if i % 50 == 0:
            for shard, batch in pages.drain_routed(routes).items():
                indexes[shard].apply(batch)
    for shard, batch in pages.drain_routed(routes).items():
        indexes[shard].apply(batch)
    assert len(pages) <= cap and len(pages._owner) <= cap and not pages._changed
    assert pages.stats.dropped_entries > 0
    published: dict[bytes, Any] = {}
    for index in indexes:
        published.update(index.node_pages(NODE))
    held = pages.held()
    assert published == held and 0 < len(held) <= cap
    assert held.items() <= engine.expected().items()


def test_a_salt_is_a_namespace_apart_from_no_salt():
    # vLLM hashes a salt of "default" apart from no salt; the fabric keeps them apart too.
    assert cache_namespace(None) == cache_namespace("") != cache_namespace("default")
    assert cache_namespace("a") != cache_namespace("b")
    with pytest.raises(ValueError):
        cache_namespace(7)  # type: ignore[arg-type]


def test_an_events_new_blocks_are_keyed_by_one_native_call(monkeypatch):
    """A prefill's blocks come in one event: their keys are one chain over its tokens, the
    same keys block-by-block chaining gives (the property test above checks them all)."""
    pages = EnginePages(NODE, 1, LAYOUT, GROUPS)
    calls = []
    chain = PageKeyer.chain

    def counted(self, raw, prev=None, first_page=0):
        calls.append(first_page)
        return chain(self, raw, prev, first_page)

    monkeypatch.setattr(PageKeyer, "chain", counted)
    tokens = tuple(range(10 * PS))
    hashes = [vllm_hash(None, tokens[: (j + 1) * PS]) for j in range(10)]
    full = (PS, "GPU", 1, None, None, None, None, None)  # group 1 is the full one
    pages.apply([BlockStored(tuple(hashes[:6]), None, tokens[: 6 * PS], *full)])
    pages.apply([BlockStored(tuple(hashes[6:]), hashes[5], tokens[6 * PS :], *full)])
    assert calls == [0, 0]
    keyer = PageKeyer(cache_namespace(None), LAYOUT.fingerprint, PS)
    assert sorted(pages.held()) == sorted(keyer.keys(tokens))


def test_an_adapters_blocks_are_keyed_in_the_connectors_namespace():
    """vLLM names a LoRA adapter in every block's extra keys (with the salt on the first):
    the feed keys them under the namespace the connector stores them in, the adapter
    named by the identity the connector read from its files; an adapter the connector
    has not identified, or a block naming another adapter, is skipped."""
    identity = "a1@0123abcd"
    pages = EnginePages(NODE, 1, LAYOUT, GROUPS, adapters={"a1": identity}.get)
    tokens = tuple(range(500, 500 + 2 * PS))
    h = [vllm_hash("a1", tokens[: (i + 1) * PS]) for i in range(2)]
    common = (PS, "GPU", 1, None, None, None, "a1")
    pages.apply(
        [
            BlockStored((h[0],), None, tokens[:PS], *common, (("a1", "t1"),)),
            BlockStored((h[1],), h[0], tokens[PS:], *common, (("a1",),)),
        ]
    )
    keyer = PageKeyer(cache_namespace("t1", identity), LAYOUT.fingerprint, PS)
    assert set(pages.held()) == set(keyer.keys(list(tokens)))
    for name, extra in (("a2", (("a2", "t1"),)), ("a1", (("a2", "t1"),))):
        other = EnginePages(NODE, 1, LAYOUT, GROUPS, adapters={"a1": identity}.get)
        other.apply(
            [BlockStored((h[0],), None, tokens[:PS], PS, "GPU", 1, None, None, None, name, extra)]
        )
        assert other.held() == {} and other.stats.skipped[Skip.EXTRA_KEYS] == 1
