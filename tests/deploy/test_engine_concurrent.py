"""Eight request threads of one replica drive the reference Engine against one
node's cache actor on a real Ray cluster. Pools are about 1.1x the longest
prompt and prompts share prefixes, so other threads' puts evict between a
request's get and its put. Every output (token ids and logits) equals the
uncached run bit for bit; afterwards no hold is left and the invariants hold."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from kvfabric.actors.node.node_actor import NodeCacheActor, NodeConfig
from kvfabric.core.cache.layout import PoolName
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.deploy.reference.engine import Engine
from kvfabric.deploy.reference.model import ModelConfig, TinyLM
from kvfabric.deploy.reference.serve.server import ActorCache
from ray.cluster_utils import Cluster

CONFIG = ModelConfig()  # full/swa/full/swa, page 16, window 32 (2 pages)
PS = CONFIG.page_size
NS = "tenant"
T = 60.0
THREADS = 8
REQUESTS = 200
MAX_TOKENS = 8  # decoding widens the gap between a request's get and its put
LONGEST_PAGES = 10  # stems of up to 5 pages, tails of up to 5
POOL_PAGES = 11  # about 1.1x the longest prompt, in every pool


@pytest.fixture(scope="module")
def node():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one intra-op thread: the same summation order in every thread
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    ray.init(address=c.address)
    caps = {PoolName.FULL: PoolCapacity(POOL_PAGES, 0), PoolName.SWA: PoolCapacity(POOL_PAGES, 0)}
    actor = NodeCacheActor.options(num_cpus=0.5).remote(
        "cache-concurrent", NodeConfig(CONFIG.layout(), caps, device="cpu")
    )
    ray.get(actor.ping.remote(), timeout=T)
    yield actor
    try:
        ray.get(actor.shutdown.remote(), timeout=10)
    finally:
        ray.kill(actor)
        ray.shutdown()
        c.shutdown()
        torch.set_num_threads(threads)


def prompts(seed: int = 11, count: int = 24) -> list[list[int]]:
    """Prompts that share three stems, whole (half of them) or cut at a page, with
    tails of up to five pages: many branch at a stem's end."""
    rng = random.Random(seed)
    stems = [
        [rng.randrange(CONFIG.vocab) for _ in range(rng.randrange(2, 6) * PS)] for _ in range(3)
    ]
    out = []
    for _ in range(count):
        stem = rng.choice(stems)
        cut = len(stem) if rng.random() < 0.5 else rng.randrange(1, len(stem) // PS + 1) * PS
        out.append(
            stem[:cut] + [rng.randrange(CONFIG.vocab) for _ in range(rng.randrange(1, 5 * PS))]
        )
    assert max((len(p) + MAX_TOKENS) // PS for p in out) == LONGEST_PAGES  # whole pages stored
    return out


def test_threads_on_small_pools_equal_the_uncached_run(node):
    model = TinyLM(CONFIG)
    distinct = prompts()
    uncached = Engine(model)
    want = [uncached.generate(p, MAX_TOKENS, NS, return_logits=True) for p in distinct]
    rng = random.Random(5)
    schedule = [rng.randrange(len(distinct)) for _ in range(REQUESTS)]
    engine = Engine(model, ActorCache(node, timeout_s=T), lease_s=T)  # one replica, shared

    def serve(i: int):
        return i, engine.generate(distinct[i], MAX_TOKENS, NS, return_logits=True)

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(serve, schedule, timeout=T))
    wrong = []
    for i, got in results:
        same = got.tokens == want[i].tokens and all(
            torch.equal(a, b) for a, b in zip(got.logits, want[i].logits)
        )
        if not same:
            wrong.append((i, got.cached_tokens))
    assert not wrong, (
        f"{len(wrong)} of {len(results)} outputs differ from the uncached run: {wrong[:10]}"
    )
    # Whatever any prefix of these prompts is served from holds no NaN.
    for p in distinct:
        for pages in range(1, len(p) // PS + 1):
            hit = ray.get(node.get.remote(p[: pages * PS], NS), timeout=T)
            assert not any(torch.isnan(t).any() for t in hit.layers if t is not None), (
                f"a {hit.tokens}-token hit holds NaN"
            )
    cached = sum(g.cached_tokens for _, g in results)
    assert cached > 0 and engine.stats.stored_pages > 0  # the cache was used, under pressure
    stats = ray.get(node.stats.remote(), timeout=T)
    assert stats["leases"] == 0  # every hold was released
    assert (
        stats["pools"]["FULL/DEVICE"]["protected"] == 0
        and stats["pools"]["SWA/DEVICE"]["protected"] == 0
    )
    ray.get(node.check.remote(), timeout=T)
    audit = ray.get(node.audit.remote(), timeout=T)
    assert (audit["leaked"], audit["double_owned"], audit["unallocated"]) == (0, 0, 0)
