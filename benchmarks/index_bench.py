"""`kvfabric bench index`: the prefix index core against Ray Serve LLM's PrefixTree,
and how evenly 8 shards split the conversation trace's lookups.

A round is a lookup then an insert, as a router does: the request goes to the
node with the longest match (else round-robin) and that node's new pages are
inserted. Ours works from page keys (and, for `ratio_with_hashing`, computes
them from tokens too); the peer gets the prompt as text, one character per
token, one tenant per node, inserts as routed. Ours runs twice, each in a fresh
process: with the native extensions (KVF_NATIVE's default) and on the pure-Python
reference (KVF_NATIVE=0); each run also measures the index's bytes per cached page.
Each side's rate is the best of `--repeat` timed runs (default 5), each on a fresh index
or tree after a full collection: a short run on a shared machine otherwise measures
whatever else ran in its fraction of a second.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import secrets
import sys
import time
import tracemalloc

# Ray 2.60 turns token auth on; keep it on with a throw-away token, set before ray is
# imported (Ray reads the mode once per process), so nothing is written to ~/.ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

from kvfabric.core.cache.keys import PageKeyer
from kvfabric.core.index.events import EventBatch, PageMask, PageState
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.prefix_index import PrefixIndex
from kvfabric.core.index.sharded_index import ShardedIndex
from kvfabric.deploy.sim.trace import load_trace, request_tokens  # noqa: E402

from benchmarks import peers
from benchmarks.fresh import bench_cpu, pin, run_worker

NODES = 4
PAGE = 16


def keyed(requests: list[list[int]]) -> list[list[bytes]]:
    keyer = PageKeyer("bench", b"f" * 16, PAGE)
    return [keyer.keys(t) for t in requests]


def ours_rounds(
    all_keys: list[list[bytes]],
    tokens: list[list[int]] | None = None,
    answers: list[tuple[int, int]] | None = None,
) -> tuple[float, PrefixIndex]:
    """Rounds per second of PrefixIndex; with `tokens`, page keys are computed inside the loop.

    The routed node already holds the request's first `have` pages (its match length; 0 when
    nothing matched) and publishes the rest as one chain, as a node does after a put. Each
    round's (node, have) goes to `answers` (the Dynamo peer must route alike)."""
    if answers is None:
        answers = []
    append = answers.append
    index = PrefixIndex(MatchRule(window_pages=0))
    seqs = [0] * NODES
    names = [f"n{i}" for i in range(NODES)]
    slot = {name: i for i, name in enumerate(names)}
    keyer = PageKeyer("bench", b"f" * 16, PAGE)
    root = keyer.root
    full_device = int(PageMask.FULL_DEVICE)
    gc.collect()
    start = time.perf_counter()
    for i, keys in enumerate(all_keys):
        if tokens is not None:
            keys = keyer.keys(tokens[i])
        best = index.lookup(keys)
        if best:
            node, have = slot[best[0].node], best[0].pages
        else:
            node, have = i % NODES, 0
        append((node, have))
        if have < len(keys):
            parent = keys[have - 1] if have else root
            index.apply_chain(
                names[node],
                1,
                seqs[node],
                keys[have:],
                have,
                parent,
                full_device,
                cleared=seqs[node] == 0,
            )
            seqs[node] += 1
    return len(all_keys) / (time.perf_counter() - start), index


def index_bytes(all_keys: list[list[bytes]]) -> tuple[float, float]:
    """Bytes the index allocates per cached page (a page on two nodes counts twice), and
    its table's bytes per key (codes, records and each node's pages), as tracemalloc
    sees them (the C core allocates through PyMem, which it traces). The keys' own bytes
    objects are the caller's."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    _, index = ours_rounds(all_keys)
    gc.collect()
    total = tracemalloc.get_traced_memory()[0] - before
    stats = index.stats()
    tracemalloc.stop()
    table_index = PrefixIndex(MatchRule(window_pages=0))
    node_keys = {n: list(index.node_pages(n)) for n in index.nodes()}
    root = PageKeyer("bench", b"f" * 16, PAGE).root
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = table_index._presence  # the table alone: each node's keys, as the index set them
    for slot, keys in enumerate(node_keys.values()):
        table.open(slot)
        table.set_chain(slot, keys, 0, root, int(PageMask.FULL_DEVICE))
    table_total = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return total / stats["node_pages"], table_total / len(table)


def ours_worker(
    trace: str | None, requests: int, tokens_per_block: int, repeat: int = 1, cpu: int = -1
) -> dict:
    """The timed rounds (the best of `repeat` runs, each on a fresh index) and the memory
    figures, in this process's mode (KVF_NATIVE), pinned to `cpu` (-1: not pinned)."""
    pin(cpu)
    from kvfabric.core.cache import native
    from kvfabric.core.index import presence

    tokens = [
        request_tokens(r, tokens_per_block=tokens_per_block)
        for r in load_trace(trace, limit=requests)
    ]
    all_keys = keyed(tokens)
    answers: list[tuple[int, int]] = []
    rate = ours_rounds(all_keys, answers=answers)[0]
    rate = max([rate] + [ours_rounds(all_keys)[0] for _ in range(repeat - 1)])
    hashing = max(ours_rounds(all_keys, tokens)[0] for _ in range(repeat))
    per_page, per_key = index_bytes(all_keys)
    return {
        "native": native.ENABLED and presence.ENABLED,
        "answers": answers,
        "rounds_per_s": rate,
        "hashing_rounds_per_s": hashing,
        "bytes_per_page": per_page,
        "table_bytes_per_key": per_key,
    }


def run_ours(
    trace: str | None,
    requests: int,
    tokens_per_block: int,
    repeat: int,
    python: bool = False,
    cpu: int = -1,
) -> dict:
    """One run in a fresh process: the native path, or the pure-Python reference (`python`)."""
    args = [trace, requests, tokens_per_block, repeat, cpu]
    return run_worker("benchmarks.index_bench", args, python)


def peer_rounds(tokens: list[list[int]]) -> float:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

    texts = ["".join(map(chr, (t % 50000 + 256 for t in toks))) for toks in tokens]
    tree = PrefixTree()
    tenants = [f"n{i}" for i in range(NODES)]
    tree.add_tenants(tenants, time.time())
    gc.collect()
    start = time.perf_counter()
    for i, text in enumerate(texts):
        matched, who = tree.prefix_match(text, tenants)
        tenant = who[0] if matched and who else tenants[i % NODES]
        tree.insert(text, tenant, time.time())
    return len(texts) / (time.perf_counter() - start)


def shard_balance(all_keys: list[list[bytes]], shards: int = 8, every: int = 100) -> float:
    """Lookups per shard over the whole trace, max over mean, rebalancing every `every` lookups."""
    index = ShardedIndex(shards, MatchRule(window_pages=0))
    for i, keys in enumerate(all_keys):
        index.lookup(keys)
        if i % every == every - 1:
            index.rebalance(target=1.05)
    return index.load_max_over_mean()


def actor_latency(all_keys: list[list[bytes]], calls: int = 400) -> tuple[float, float]:
    """p50 ms of a lookup on an index shard actor, and of a no-op call to it with the
    same arguments, in one cluster."""
    import statistics

    import ray
    from kvfabric.actors.index_shard import IndexShardActor

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        shard = IndexShardActor.remote(
            0, 1, MatchRule(window_pages=0)
        )  # shard 0 of 1, full layers only
        keyer_root = PageKeyer("bench", b"f" * 16, PAGE).root
        pages = {}
        for keys in all_keys[:500]:
            for d, k in enumerate(keys):
                pages[k] = PageState(k, keys[d - 1] if d else keyer_root, d, PageMask.FULL_DEVICE)
        ray.get(
            shard.apply.remote(
                EventBatch("n0", 1, 0, tuple(pages.values()), cleared=True).encode()
            ),
            timeout=60,
        )

        def p50(call) -> float:
            times = []
            for i in range(calls):
                t = time.perf_counter()
                ray.get(call(i), timeout=30)
                times.append(time.perf_counter() - t)
            return statistics.median(times[calls // 10 :]) * 1e3

        blobs = [b"".join(k) for k in all_keys[:500]]
        lookup = p50(lambda i: shard.lookup.remote(blobs[i % len(blobs)], 0))
        # The same call shape (same arguments) doing nothing: what remains is the lookup.
        noop = p50(lambda i: shard.noop.remote(blobs[i % len(blobs)], 0))
        bare = p50(lambda i: shard.noop.remote())
        print(f"(a no-op call without arguments: {bare:.3f} ms)")
        return lookup, noop
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--scale" in argv:  # the table's memory and lookups over slot counts: its own module
        from benchmarks.index_scale import main as scale

        return scale(argv)
    ap = argparse.ArgumentParser(prog="kvfabric bench index", description=__doc__)
    ap.add_argument(
        "--trace", default=None, help="a Mooncake-format trace (default: the packaged one)"
    )
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="timed runs per side, each on a fresh index or tree; the best counts (a shared "
        "machine's pauses land in some runs, not in the work)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    reqs = load_trace(args.trace, limit=args.requests)
    tokens = [request_tokens(r, tokens_per_block=args.tokens_per_block) for r in reqs]
    all_keys = keyed(tokens)
    cpu = bench_cpu()
    fast = run_ours(args.trace, args.requests, args.tokens_per_block, args.repeat, cpu=cpu)
    slow = run_ours(args.trace, args.requests, args.tokens_per_block, args.repeat, True, cpu)
    ours, ours_hashing = fast["rounds_per_s"], fast["hashing_rounds_per_s"]
    dynamo = peers.run_dynamo_rounds(tokens, PAGE, NODES, args.repeat, cpu)
    answers = [tuple(a) for a in fast["answers"]]
    for name, got in (("the pure-Python run", slow["answers"]), ("Dynamo", dynamo.answers)):
        if [tuple(a) for a in got] != answers:
            raise RuntimeError(f"{name} routed the rounds unlike ours: the sides must agree")
    peer = max(peer_rounds(tokens) for _ in range(args.repeat))
    full = [
        request_tokens(r, tokens_per_block=args.tokens_per_block) for r in load_trace(args.trace)
    ]
    full_keys = keyed(full)
    balance = shard_balance(full_keys)
    lookup_ms, noop_ms = actor_latency(all_keys)
    print(
        f"{len(tokens)} requests, {args.tokens_per_block} tokens/block, page {PAGE}, {NODES} nodes"
    )
    kind = "native" if fast["native"] else "no extension!"
    print(
        f"ours ({kind}) {ours:.0f} rounds/s, with hashing {ours_hashing:.0f}; pure Python "
        f"{slow['rounds_per_s']:.0f}, with hashing {slow['hashing_rounds_per_s']:.0f}; PrefixTree "
        f"{peer:.0f}"
    )
    print(
        f"Dynamo RadixTree (Rust, pinned to CPU {cpu} as ours) {dynamo.rounds_per_s:.0f} "
        f"rounds/s, with hashing {dynamo.hashing_rounds_per_s:.0f}: ratio "
        f"{ours / dynamo.rounds_per_s:.2f} (target >= 3), with hashing "
        f"{ours_hashing / dynamo.hashing_rounds_per_s:.2f} (target >= 2)"
    )
    print(
        f"ratio {ours / peer:.2f} (target >= 10), with hashing {ours_hashing / peer:.2f} (target "
        ">= 3); "
        f"pure Python {slow['rounds_per_s'] / peer:.2f}, with hashing "
        f"{slow['hashing_rounds_per_s'] / peer:.2f}"
    )
    print(
        f"index bytes per cached page {fast['bytes_per_page']:.0f} (pure Python "
        f"{slow['bytes_per_page']:.0f}); "
        f"index table per key (codes, records, node pages) "
        f"{fast['table_bytes_per_key']:.0f} (pure Python "
        f"{slow['table_bytes_per_key']:.0f})"
    )
    print(f"8 shards over {len(full)} requests: lookups max/mean {balance:.3f} (target <= 1.25)")
    print(
        f"actor lookup p50 {lookup_ms:.3f} ms, no-op call p50 {noop_ms:.3f} ms "
        f"({lookup_ms / noop_ms:.2f}x, target <= 1.3x)"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "name": "index",
                    "native": fast["native"],
                    "repeat": args.repeat,
                    "ours_lookups_per_s": round(ours, 1),
                    "ours_python_lookups_per_s": round(slow["rounds_per_s"], 1),
                    "ratio_python": round(slow["rounds_per_s"] / peer, 3),
                    "ratio_with_hashing_python": round(slow["hashing_rounds_per_s"] / peer, 3),
                    "bytes_per_page": round(fast["bytes_per_page"], 1),
                    "bytes_per_page_python": round(slow["bytes_per_page"], 1),
                    "table_bytes_per_key": round(fast["table_bytes_per_key"], 1),
                    "table_bytes_per_key_python": round(slow["table_bytes_per_key"], 1),
                    "cpu": cpu,
                    "dynamo_rounds_per_s": round(dynamo.rounds_per_s, 1),
                    "dynamo_hashing_rounds_per_s": round(dynamo.hashing_rounds_per_s, 1),
                    "ratio_vs_dynamo": round(ours / dynamo.rounds_per_s, 3),
                    "ratio_vs_dynamo_hashing": round(ours_hashing / dynamo.hashing_rounds_per_s, 3),
                    "peer": "ray.serve PrefixTree",
                    "peer_lookups_per_s": round(peer, 1),
                    "ratio": round(ours / peer, 3),
                    "ratio_with_hashing": round(ours_hashing / peer, 3),
                    "actor_lookup_p50_ms": round(lookup_ms, 3),
                    "noop_actor_call_p50_ms": round(noop_ms, 3),
                    "shards": 8,
                    "shard_load_max_over_mean": round(balance, 3),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
