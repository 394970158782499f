"""The Dynamo peer's worker process: Dynamo's Rust KV indexer (``dynamo.llm.RadixTree``) on
the index benchmark's rounds.

``benchmarks/peers.py`` and ``benchmarks/index_bench.py`` run this file as a script with
``python -I``, the Dynamo folder appended after our site-packages. Only the stdlib and
``sglang_worker``'s sequence file helpers are used here, so it needs nothing of ours.

``python -I dynamo_worker.py check FOLDER``: import Dynamo from FOLDER and check one match.
``python -I dynamo_worker.py rounds FOLDER DATA PAGE NODES REPEAT RESULT CPU``: time the
rounds over the token sequences in DATA, pinned to CPU (-1: not pinned), best of REPEAT runs
each on a fresh tree, and write the result JSON to RESULT.

A round is the index bench's: find the worker with the longest match (ties: the lowest
worker id, as ours breaks them by node name; no match: round-robin), then that worker
publishes the request's pages past its match as one "stored" event. The events are built
before the timed runs, from an untimed pass that routes the same way: what a router receives
from its engines, in the wire format ``RadixTree.apply_event`` takes (the
``dump_tree_as_events`` format: ``{"event_id", "data": {"stored": {"parent_hash", "blocks":
[{"block_hash", "tokens_hash"}]}}, "dp_rank"}``; ``tokens_hash`` is the block's
``compute_block_hash_for_seq`` hash, ``block_hash`` the engine's id for the block in its
sequence, here a counter per distinct prefix). Every timed run must route as that pass did.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # -I leaves benchmarks/ out
from sglang_worker import read_sequences  # noqa: E402

Answer = tuple[int, int]  # (worker routed to, pages it already held)


def _import_dynamo(folder: Path):
    sys.path.append(str(folder))  # after our site-packages
    from dynamo.llm import RadixTree, compute_block_hash_for_seq

    return RadixTree, compute_block_hash_for_seq


def _route(scores: dict, i: int, nodes: int) -> Answer:
    if not scores:
        return i % nodes, 0
    best, have = -1, 0
    for (worker, _dp_rank), pages in scores.items():
        if pages > have or (pages == have and worker < best):
            best, have = worker, pages
    return best, have


def _events(hashes: list[list[int]], nodes: int, RadixTree) -> tuple[list, list[Answer]]:
    """Each round's stored event (None when the routed worker holds the whole request) and
    the routing, from one untimed pass."""
    tree = RadixTree()
    ids: dict[tuple[int, int], int] = {}  # (parent block id, tokens hash) -> block id
    seqs = [0] * nodes
    events: list[bytes | None] = []
    answers: list[Answer] = []
    for i, local in enumerate(hashes):
        worker, have = _route(tree.find_matches(local).scores, i, nodes)
        answers.append((worker, have))
        chain, parent = [], 0
        for h in local:
            parent = ids.setdefault((parent, h), len(ids) + 1)
            chain.append(parent)
        if have == len(local):
            events.append(None)
            continue
        blocks = [{"block_hash": b, "tokens_hash": h} for b, h in zip(chain, local)][have:]
        stored = {"parent_hash": chain[have - 1] if have else None, "blocks": blocks}
        event = {"event_id": seqs[worker], "data": {"stored": stored}, "dp_rank": 0}
        seqs[worker] += 1
        events.append(json.dumps(event).encode())
        tree.apply_event(worker, events[-1])
    return events, answers


def _rounds(
    RadixTree,
    hashes: list[list[int]],
    events: list,
    nodes: int,
    hash_seq: Callable[[list[int], int], list[int]] | None = None,
    tokens: list[list[int]] | None = None,
    page: int = 0,
) -> tuple[float, list[Answer]]:
    """Rounds per second on a fresh tree; with `hash_seq`, block hashes are computed from
    `tokens` inside the loop. _route's choice, inline (no frame per round)."""
    tree = RadixTree()
    answers: list[Answer] = []
    append, find, apply = answers.append, tree.find_matches, tree.apply_event
    gc.collect()
    start = time.perf_counter()
    for i, local in enumerate(hashes):
        if hash_seq is not None and tokens is not None:
            local = hash_seq(tokens[i], page)
        scores = find(local).scores
        if scores:
            worker, have = -1, 0
            for (w, _dp_rank), pages in scores.items():
                if pages > have or (pages == have and w < worker):
                    worker, have = w, pages
        else:
            worker, have = i % nodes, 0
        event = events[i]
        if event is not None:
            apply(worker, event)
        append((worker, have))
    return len(hashes) / (time.perf_counter() - start), answers


def main(argv: list[str]) -> None:
    mode, folder = argv[0], Path(argv[1])
    if mode == "check":
        RadixTree, hash_seq = _import_dynamo(folder)
        local = hash_seq(list(range(40)), 16)
        events, _ = _events([local, local], 2, RadixTree)
        tree = RadixTree()
        tree.apply_event(0, events[0])
        scores = tree.find_matches(local).scores
        if len(local) != 2 or scores != {(0, 0): 2}:
            raise SystemExit(f"Dynamo self-check: {len(local)} blocks, scores {scores}")
        return
    if mode != "rounds":
        raise SystemExit(f"unknown worker mode {mode!r}")
    data, page, nodes, repeat = Path(argv[2]), int(argv[3]), int(argv[4]), int(argv[5])
    result, cpu = Path(argv[6]), int(argv[7])
    if cpu >= 0:  # before Dynamo starts its indexer's thread, which inherits it
        os.sched_setaffinity(0, {cpu})
    RadixTree, hash_seq = _import_dynamo(folder)
    tokens = [list(s) for s in read_sequences(data)]
    hashes = [hash_seq(t, page) for t in tokens]
    events, expected = _events(hashes, nodes, RadixTree)
    rate, hashing = 0.0, 0.0
    for _ in range(repeat):
        r, got = _rounds(RadixTree, hashes, events, nodes)
        h, got_hashing = _rounds(RadixTree, hashes, events, nodes, hash_seq, tokens, page)
        if got != expected or got_hashing != expected:
            raise SystemExit("Dynamo routed a timed run unlike the pass that built its events")
        rate, hashing = max(rate, r), max(hashing, h)
    out = {"rounds_per_s": rate, "hashing_rounds_per_s": hashing, "answers": expected}
    result.write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
