"""`kvfabric bench index --scale`: the index table's bytes per cached page and lookup time
as the node slots grow from 8 to 4,096, against itself at 8 slots.

One seeded workload at every slot count: conversations of chained pages, each held by
1-3 random slots, a quarter of them after one of 4 hot system prompts (8 pages each)
that `--hot-holders` random slots hold (default 8: the same workload at every slot
count, all 8 slots at 8; more makes each hot lookup's answer longer, whatever the
table). Every slot is open. The presence table alone
(presence.new_presence, the C core or the reference), as PrefixIndex drives it: each
holder publishes its chain with set_chain.

Bytes: tracemalloc's traced bytes of the table after the chains minus after opening the
slots (the C core allocates through PyMem, which tracemalloc traces; the keys' own bytes
objects are the caller's and not counted), per cached page (a page two slots hold counts
twice, as index_bench counts it) and per held key. Lookups: the table's lookup of each
conversation's keys (its prompt's, then its own), microseconds per key looked up, the
best of `--repeat` passes, each after a full collection with the collector off while
timing; one warm-up pass first. Single-threaded: nothing to pin. Each mode (native, and
the pure-Python reference with --python) runs in a fresh process.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass

from kvfabric.core.index.events import PageMask
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.presence import PresenceTable, new_presence

from benchmarks.fresh import run_worker

SLOTS = (8, 64, 512, 4096)
PROMPTS, PROMPT_PAGES = 4, 8
ROOT = b"\x00" * 16


@dataclass(frozen=True)
class Conversation:
    prompt: int  # -1: none
    keys: list[bytes]
    holders: list[int]


@dataclass(frozen=True)
class Row:
    slots: int
    held_keys: int
    cached_pages: int
    bytes_per_page: float
    bytes_per_key: float
    lookup_us_per_key: float


def workload(
    slots: int, conversations: int, seed: int, hot_holders: int = 8
) -> tuple[list[list[bytes]], list[list[int]], list[Conversation]]:
    """The same keys at every slot count (one seed); holders drawn among `slots`."""
    keys_rng, rng = random.Random(seed), random.Random(seed * 7919 + slots)
    prompts = [[keys_rng.randbytes(16) for _ in range(PROMPT_PAGES)] for _ in range(PROMPTS)]
    hot = [rng.sample(range(slots), min(slots, hot_holders)) for _ in prompts]
    convs = []
    for i in range(conversations):
        prompt = keys_rng.randrange(PROMPTS) if i % 4 == 0 else -1
        keys = [keys_rng.randbytes(16) for _ in range(keys_rng.randint(8, 64))]
        pool = hot[prompt] if prompt >= 0 else range(slots)
        convs.append(Conversation(prompt, keys, rng.sample(pool, rng.randint(1, min(3, slots)))))
    return prompts, hot, convs


def publish(
    table: PresenceTable,
    prompts: list[list[bytes]],
    hot: list[list[int]],
    convs: list[Conversation],
) -> None:
    mask = int(PageMask.FULL_DEVICE)
    for keys, holders in zip(prompts, hot):
        for s in holders:
            table.set_chain(s, keys, 0, ROOT, mask)
    for c in convs:
        parent, depth = (prompts[c.prompt][-1], PROMPT_PAGES) if c.prompt >= 0 else (ROOT, 0)
        for s in c.holders:
            table.set_chain(s, c.keys, depth, parent, mask)


def measure(slots: int, conversations: int, repeat: int, seed: int, hot_holders: int) -> Row:
    prompts, hot, convs = workload(slots, conversations, seed, hot_holders)
    rule = MatchRule(window_pages=0)
    gc.collect()
    tracemalloc.start()
    table = new_presence(rule)
    for s in range(slots):
        table.open(s)
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    publish(table, prompts, hot, convs)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    cached = sum(map(table.count, range(slots)))
    requests = [(prompts[c.prompt] if c.prompt >= 0 else []) + c.keys for c in convs]
    looked_up = sum(map(len, requests))
    lookup = table.lookup
    for keys in requests:  # warm-up: the scratch arrays' first growth, caches
        lookup(keys)
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        for keys in requests:
            lookup(keys)
        best = min(best, time.perf_counter() - start)
        gc.enable()
    return Row(
        slots, len(table), cached, grown / cached, grown / len(table), best / looked_up * 1e6
    )


def ours_worker(
    conversations: int, repeat: int, seed: int, slots: list[int], hot_holders: int
) -> dict:
    """Every slot count's row, in this process's mode (KVF_NATIVE)."""
    from kvfabric.core.index import presence

    rows = [asdict(measure(n, conversations, repeat, seed, hot_holders)) for n in slots]
    return {"native": presence.ENABLED, "rows": rows}


def ratios(rows: list[dict]) -> dict:
    first, last = rows[0], rows[-1]
    tag = f"{last['slots']}_vs_{first['slots']}"
    return {
        f"bytes_per_page_ratio_{tag}": round(last["bytes_per_page"] / first["bytes_per_page"], 3),
        f"lookup_ratio_{tag}": round(last["lookup_us_per_key"] / first["lookup_us_per_key"], 3),
    }


def show(title: str, rows: list[dict]) -> None:
    print(title)
    print(
        f"{'slots':>6} {'keys':>8} {'cached':>8} {'B/page':>8} {'B/key':>8} {'lookup us/key':>14}"
    )
    for r in rows:
        print(
            f"{r['slots']:>6} {r['held_keys']:>8} {r['cached_pages']:>8} "
            f"{r['bytes_per_page']:>8.1f} {r['bytes_per_key']:>8.1f} "
            f"{r['lookup_us_per_key']:>14.3f}"
        )
    tag = ratios(rows)
    print("  ".join(f"{k} {v}" for k, v in tag.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench index --scale", description=__doc__)
    ap.add_argument("--scale", action="store_true", help="(this benchmark)")
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5, help="timed lookup passes; the best counts")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hot-holders", type=int, default=8, help="slots holding each hot prompt")
    ap.add_argument(
        "--slots", type=int, nargs="+", default=list(SLOTS), help="slot counts, first the base"
    )
    ap.add_argument("--python", action="store_true", help="the pure-Python reference too")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if min(args.repeat, args.conversations, args.hot_holders, *args.slots) < 1:
        ap.error("--repeat, --conversations, --hot-holders and --slots must be >= 1")
    work = [args.conversations, args.repeat, args.seed, args.slots, args.hot_holders]
    fast = run_worker("benchmarks.index_scale", work)
    kind = "native" if fast["native"] else "no extension!"
    print(
        f"{args.conversations} conversations (1-3 holders; {PROMPTS} hot prompts of "
        f"{PROMPT_PAGES} pages, min(slots, {args.hot_holders}) holders); bytes by tracemalloc"
    )
    show(f"presence table ({kind})", fast["rows"])
    out = {"name": "index-scale", "native": fast["native"], "hot_holders": args.hot_holders}
    out["rows"] = fast["rows"]
    out.update(ratios(fast["rows"]))
    if args.python:
        slow = run_worker("benchmarks.index_scale", work, python=True)
        show("presence table (pure-Python reference)", slow["rows"])
        out["python_rows"] = slow["rows"]
        out.update({f"python_{k}": v for k, v in ratios(slow["rows"]).items()})
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
