"""The reference model and the per-node engine: output with cache hits (device,
host, after SWA tombstoning, fetched from another node) equals output without
any cache, bit for bit; the cost model decides fetches; bad requests fail clearly."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.cache.layout import PoolName, Tier
from kvfabric.core.cache.leases import LeaseTable
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig, WritePolicy
from kvfabric.core.exchange.destination import import_prefix
from kvfabric.core.exchange.source import export_prefix
from kvfabric.deploy.reference.engine import CostModel, Engine, RequestError
from kvfabric.deploy.reference.model import KVState, ModelConfig, TinyLM

from tests.engine_checks import assert_no_nan, assert_same

CONFIG = ModelConfig()  # 4 layers full/swa/full/swa, page 16, window 32 (2 pages)
MODEL = TinyLM(CONFIG)
PS = CONFIG.page_size
NS = "tenant"
FAST_FETCH = CostModel(prefill_tokens_per_s=1e3, transfer_bytes_per_s=1e12, fetch_overhead_s=0.0)
SLOW_FETCH = CostModel(prefill_tokens_per_s=1e9, transfer_bytes_per_s=1.0, fetch_overhead_s=1.0)


def cache(full=(64, 0), swa=(32, 0), policy=WritePolicy.WRITE_BACK) -> NodeCache:
    return NodeCache(
        CONFIG.layout(),
        {PoolName.FULL: PoolCapacity(*full), PoolName.SWA: PoolCapacity(*swa)},
        tier=TierConfig(policy=policy),
        device="cpu",
    )


def toks(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab, (n,), generator=g).tolist()


def reference(prompt, max_tokens=6):
    return Engine(MODEL).generate(prompt, max_tokens, NS, return_logits=True)


class InProcessRemote:
    """Node B's cache seen from node A through the real export/import
    transaction; the page reads (NIXL's job) are done in process."""

    def __init__(self, dst: NodeCache, src: NodeCache) -> None:
        self.dst, self.src, self.leases = dst, src, LeaseTable(src)
        self.fetches = 0

    def best_remote(self, tokens, namespace):
        return self.src.match(tokens, namespace).usable_pages

    def fetch(self, tokens, namespace):
        self.fetches += 1
        have = self.dst.match(tokens, namespace).present_pages
        grant = export_prefix(self.src, self.leases, self.dst.keys(tokens, namespace), have, 5.0)
        try:
            import_prefix(self.dst, tokens, namespace, grant, self._read)
        finally:
            if grant.lease_id:
                self.leases.release(grant.lease_id)
        return self.dst.match(tokens, namespace).usable_pages

    def _read(self, pool, refs, pages):
        dst = self.dst.registry.pool(pool, Tier.DEVICE).data
        for (tier, index), page in zip(refs, pages):
            dst[page] = self.src.registry.pool(pool, tier).data[index]


# --- the model alone -------------------------------------------------------------------
def test_model_is_seeded_and_layout_matches():
    again = TinyLM(ModelConfig())
    assert torch.equal(again.embed, MODEL.embed) and torch.equal(again.lm_head, MODEL.lm_head)
    assert not torch.equal(TinyLM(ModelConfig(seed=1)).embed, MODEL.embed)
    lay = CONFIG.layout()
    assert [k.value for k in lay.layers] == list(CONFIG.layers)
    assert (lay.kv_heads, lay.head_dim, lay.page_size, lay.window) == (2, 16, 16, 32)
    _, state = MODEL.prefill(toks(40, 0))
    kv, starts = state.for_put(32, lay)
    assert all(tuple(t.shape) == (2, 32, 2, 16) for t in kv) and set(starts.values()) == {0}


def test_swa_layers_see_only_the_window():
    # A state whose SWA layers keep only the last window of history gives the
    # same bits as the whole history: SWA layers read nothing older. One that
    # keeps less than the next token needs is refused, never silently used.
    prompt = toks(80, 1)
    _, state = MODEL.prefill(prompt[:64])
    swa = (0, 1, 0, 1)
    cut = KVState(
        [t if s == 0 else t[:, 32:] for t, s in zip(state.layers, swa)], [0, 32, 0, 32], 64
    )
    (ids, logits), (want_ids, want_logits) = (
        MODEL.generate(prompt, 4, cut),
        MODEL.generate(prompt, 4),
    )
    assert ids == want_ids and all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    short = KVState(
        [t if s == 0 else t[:, 48:] for t, s in zip(state.layers, swa)], [0, 48, 0, 48], 64
    )
    with pytest.raises(ValueError, match="needs keys from"):
        MODEL.prefill(prompt, short)


# --- cache transparency ----------------------------------------------------------------
@pytest.mark.parametrize(
    "first,second",
    [
        (70, 64),  # whole prompt cached: the last logits are still recomputed
        (70, 90),  # hit of 4 pages, a partial page computed
        (64, 64 + 16),  # page-aligned prompts
        (21, 37),  # one page cached, SWA window shorter than the window
    ],
)
def test_device_hit_equals_no_cache(first, second):
    c = cache()
    engine = Engine(MODEL, c)
    shared = toks(max(first, second), 2)
    a, b = shared[:first], shared[:second]
    assert_same(engine.generate(a, 6, NS, return_logits=True), reference(a))
    got = engine.generate(b, 6, NS, return_logits=True)
    assert got.cached_tokens == min(first, second) // PS * PS > 0
    assert got.device_tokens == got.cached_tokens and got.host_tokens == got.remote_tokens == 0
    assert_same(got, reference(b))
    c.check()


def test_host_hit_equals_no_cache():
    c = cache(full=(16, 32), swa=(8, 16), policy=WritePolicy.WRITE_BACK)
    engine = Engine(MODEL, c)
    prompt = toks(100, 3)
    engine.generate(prompt[:80], 4, NS)
    c.evict(PoolName.FULL, Tier.DEVICE, 16)
    c.evict(PoolName.SWA, Tier.DEVICE, 8)
    assert c.match(prompt, NS).usable_device_pages == 0 and c.match(prompt, NS).usable_pages == 5
    got = engine.generate(prompt, 6, NS, return_logits=True)
    assert got.cached_tokens == 80 and got.host_tokens == 80 and got.device_tokens == 0
    assert engine.stats.hit_tokens_host == 80
    assert_same(got, reference(prompt))
    c.check()


def test_hit_after_swa_tombstoning_uses_the_shorter_window():
    c = cache(swa=(32, 0))  # no SWA host tier: eviction tombstones
    engine = Engine(MODEL, c)
    stem, b_tail, c_tail = toks(64, 4), toks(32, 5), toks(32, 6)
    engine.generate(stem + b_tail, 2, NS)  # SWA kept for pages 4, 5 only
    engine.generate(stem + c_tail, 2, NS)  # branch at page 4 keeps pages 2, 3 too
    assert c.evict(PoolName.SWA, Tier.DEVICE, 2) >= 2  # least recent: the first tail's window
    prompt = stem + b_tail + toks(10, 7)
    m = c.match(prompt, NS)
    assert m.present_pages == 6 and m.usable_pages == 4  # full KV for 6 pages, usable only 4
    hit = c.get(prompt, NS)
    assert (hit.tokens, hit.starts[PoolName.SWA]) == (64, 32)
    got = engine.generate(prompt, 6, NS, return_logits=True)
    assert got.cached_tokens == 64
    assert_same(got, reference(prompt))
    assert c.match(prompt, NS).usable_pages == 6  # the recomputed window was stored again
    assert_no_nan(c)
    c.check()


def test_remote_hit_equals_no_cache():
    a, b = cache(), cache()
    remote = InProcessRemote(a, b)
    prompt = toks(120, 8)
    Engine(MODEL, b).generate(prompt[:96], 2, NS)  # node B computed 6 pages
    engine = Engine(MODEL, a, remote=remote, cost=FAST_FETCH)
    engine.generate(prompt[:32], 2, NS)  # node A has 2 of them
    got = engine.generate(prompt, 6, NS, return_logits=True)
    assert got.fetch == "fetched" and remote.fetches == 1
    assert (got.cached_tokens, got.device_tokens, got.remote_tokens) == (96, 32, 64)
    assert engine.stats.fetched_bytes > 0 and engine.stats.hit_tokens_remote == 64
    assert_same(got, reference(prompt))
    a.check()
    b.check()


# --- the cost model --------------------------------------------------------------------
def test_fetch_skipped_when_recompute_is_cheaper_and_taken_when_not():
    prompt = toks(100, 9)
    src = cache()
    Engine(MODEL, src).generate(prompt, 1, NS)
    slow_dst, fast_dst = cache(), cache()
    slow = Engine(MODEL, slow_dst, remote=InProcessRemote(slow_dst, src), cost=SLOW_FETCH)
    got = slow.generate(prompt, 3, NS)
    assert got.fetch == "skipped" and got.cached_tokens == 0 and slow.remote.fetches == 0
    assert slow.stats.fetches_skipped == 1 and slow.stats.fetches == 0
    fast = Engine(MODEL, fast_dst, remote=InProcessRemote(fast_dst, src), cost=FAST_FETCH)
    got = fast.generate(prompt, 3, NS)
    assert got.fetch == "fetched" and got.remote_tokens == 96 and fast.stats.fetches == 1
    assert SLOW_FETCH.transfer_s(1000) > SLOW_FETCH.recompute_s(1000)
    assert FAST_FETCH.should_fetch(16, 10_000) and not FAST_FETCH.should_fetch(0, 0)


def test_measured_cost_model_and_failing_remote_degrades(caplog):
    cost = CostModel.measure(MODEL)
    assert cost.prefill_tokens_per_s > 0

    class Broken:
        def best_remote(self, tokens, namespace):
            return 6

        def fetch(self, tokens, namespace):
            raise ConnectionError("peer died")

    engine = Engine(MODEL, cache(), remote=Broken(), cost=FAST_FETCH)
    prompt = toks(100, 10)
    got = engine.generate(prompt, 4, NS, return_logits=True)
    assert got.fetch == "failed" and engine.stats.fetch_failures == 1
    assert_same(got, reference(prompt, 4))
    # Swallowed, but said: an operator sees why requests recompute.
    assert any("peer died" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


# --- validation ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt,max_tokens,ns",
    [
        ([], 4, NS),
        ([1, 2, CONFIG.vocab], 4, NS),
        ([1, -1], 4, NS),
        ([1, 2.0], 4, NS),
        ([1, True], 4, NS),
        ("abc", 4, NS),
        ([1] * CONFIG.max_positions, 1, NS),
        ([1, 2], -1, NS),
        ([1, 2], 4, ""),
    ],
)
def test_bad_requests_raise_request_error(prompt, max_tokens, ns):
    engine = Engine(MODEL, cache())
    with pytest.raises(RequestError):
        engine.generate(prompt, max_tokens, ns)
    assert engine.stats.requests == 0
    assert issubclass(RequestError, ValueError)


def test_unusable_cache_answer_is_recomputed():
    class Liar:
        """Answers a hit whose tensors have the wrong shape."""

        def get(self, tokens, namespace, lease_s=None):
            real = c.get(tokens, namespace, lease_s)
            real.layers = [t[:, 1:] if t is not None else t for t in real.layers]
            return real

        def put(self, tokens, kv, namespace, **rows):
            return c.put(tokens, kv, namespace, **rows)

        def release_lease(self, lease):
            return c.release_lease(lease)

    c = cache()
    prompt = toks(50, 11)
    engine = Engine(MODEL, Liar())
    engine.generate(prompt, 1, NS)
    got = engine.generate(prompt, 4, NS, return_logits=True)
    assert got.cached_tokens == 0 and engine.stats.unusable_hits == 1
    assert_same(got, reference(prompt, 4))


# --- property: any cache history is transparent ------------------------------------------
REQUESTS = st.lists(
    st.tuples(
        st.integers(1, 40),
        st.integers(0, 1),
        st.just(0) | st.integers(1, 4),
        st.just(0) | st.integers(1, 2),
    ),
    min_size=1,
    max_size=4,
)


@given(stem=st.integers(0, 60), requests=REQUESTS, seed=st.integers(0, 2**16), host=st.booleans())
def test_output_with_cache_equals_without(stem, requests, seed, host):
    # Prompts share a stem, and with two tail seeds they also repeat and extend
    # one another. Before each, some device pages are evicted: to host (hits
    # loaded back) or away (FULL gone, SWA tombstoned); small pools evict too.
    c = cache(full=(8, 16 * host), swa=(4, 8 * host))
    engine = Engine(MODEL, c)
    shared = toks(stem, seed)
    for length, tail_seed, evict_full, evict_swa in requests:
        c.evict(PoolName.FULL, Tier.DEVICE, evict_full)
        c.evict(PoolName.SWA, Tier.DEVICE, evict_swa)
        prompt = shared + toks(length, seed + 1 + tail_seed)
        got = engine.generate(prompt, 3, NS, return_logits=True)
        assert got.cached_tokens + got.computed_tokens == len(prompt)
        assert got.device_tokens + got.host_tokens == got.cached_tokens
        assert_same(got, reference(prompt, 3))
    assert_no_nan(c)
    c.check()


def test_a_conversations_next_turn_hits_the_previous_answer():
    """Prompt and output pages are stored (the output recomputed in page chunks), so
    the next turn, which repeats both, is served from cache past the old prompt, and
    its output still equals the uncached one bit for bit; a retry of the first
    prompt still hits all of its pages."""
    c = cache(full=(64, 0), swa=(32, 0))
    engine = Engine(MODEL, c)
    first = toks(40, 21)  # 2 whole pages and a part
    turn1 = engine.generate(first, 30, NS)
    nxt = first + turn1.tokens + toks(20, 22)  # 90 tokens: 5 whole pages
    got = engine.generate(nxt, 6, NS, return_logits=True)
    assert got.cached_tokens == 64  # (40 + 30) // 16 pages, past the old 32
    assert_same(got, reference(nxt))
    again = engine.generate(first, 4, NS, return_logits=True)
    assert again.cached_tokens == 32
    assert_same(again, reference(first, 4))
    assert_no_nan(c)
    c.check()
