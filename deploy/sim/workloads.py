"""Generated traces in the Mooncake format, of the shapes a shared KV cache meets.

Every shape is conversations: a conversation starts with a shared prefix picked by
Zipf popularity from a pool (a system prompt, or an instruction and a document), then
takes turns. Each turn's prompt is the previous prompt plus its answer plus a new user
message, after a log-normal think time; as in the real trace, a turn keeps the hash ids
of the previous prompt's whole blocks, and its partial last block and everything after
get new ids. Conversations start as a Poisson process.

  apps      several applications, each with its own system prompt, short sessions;
  docs      Zipf-popular shared documents under a few instructions, questions on them;
  sessions  long multi-turn sessions under a few system prompts;
  hot       a few very hot long prefixes (shared documents), one question each: one
            node cannot serve all of one, so others fetch it (hot-prefix replication);
  long      long contexts (a code base, a contract: 32k to 100k tokens) from a pool too big
            for a node's device, a few follow-ups on each: what a tier below the device pays on;
  mixed     apps, docs and sessions, a conversation of each kind in turn at random.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from enum import Enum

from .trace import BLOCK_TOKENS

MAX_PROMPT_TOKENS = 128_000


@dataclass(frozen=True)
class Kind:
    """One kind of conversation: its prefix pool and its turns."""

    prefixes: int  # shared prefixes in the pool
    prefix_blocks: tuple[int, int]  # a prefix's length in blocks (uniform)
    zipf: float  # popularity exponent over the pool
    p_continue: float  # chance of another turn
    user_tokens: tuple[int, int]  # a user message's length (uniform)
    think_median_s: float = 60.0
    heads: int = 0  # prefixes share one of this many 1-block heads (0: none)


class Shape(str, Enum):
    APPS = "apps"
    DOCS = "docs"
    SESSIONS = "sessions"
    HOT = "hot"
    LONG = "long"
    MIXED = "mixed"


KINDS = {
    Shape.APPS: Kind(
        prefixes=12, prefix_blocks=(1, 16), zipf=1.0, p_continue=0.5, user_tokens=(100, 2000)
    ),
    Shape.DOCS: Kind(
        prefixes=300,
        prefix_blocks=(4, 40),
        zipf=1.1,
        p_continue=0.3,
        user_tokens=(50, 800),
        heads=3,
    ),
    Shape.SESSIONS: Kind(
        prefixes=4,
        prefix_blocks=(1, 4),
        zipf=1.0,
        p_continue=0.92,
        user_tokens=(200, 3000),
        think_median_s=30.0,
    ),
    Shape.HOT: Kind(
        prefixes=6, prefix_blocks=(16, 48), zipf=1.2, p_continue=0.0, user_tokens=(50, 800)
    ),
    Shape.LONG: Kind(
        prefixes=200,
        prefix_blocks=(64, 200),
        zipf=0.8,
        p_continue=0.6,
        user_tokens=(50, 1000),
        think_median_s=20.0,
    ),
}
MIXED = (Shape.APPS, Shape.DOCS, Shape.SESSIONS)


def generate(shape: Shape, n: int, seed: int = 0, new_per_s: float = 1.0) -> list[dict]:
    """`n` requests of `shape`, as Mooncake trace rows in arrival order."""
    kinds = [KINDS[s] for s in MIXED] if shape is Shape.MIXED else [KINDS[shape]]
    return conversations(kinds, n, seed, new_per_s)


def conversations(
    kinds: list[Kind],
    n: int,
    seed: int = 0,
    new_per_s: float = 1.0,
    output_tokens: tuple[int, int] = (20, 800),
) -> list[dict]:
    """`n` requests of conversations of `kinds` (each new conversation picks one)."""
    rng = random.Random(seed)
    ids = itertools.count()
    pools = [_pool(k, rng, ids) for k in kinds]
    rows: list[dict] = []
    t = 0.0
    while len(rows) < 4 * n:
        t += rng.expovariate(new_per_s)
        which = rng.randrange(len(kinds))
        kind, (prefixes, weights) = kinds[which], pools[which]
        prefix = rng.choices(prefixes, weights)[0]
        length, hashes, at = len(prefix) * BLOCK_TOKENS, list(prefix), t
        while True:
            length += rng.randint(*kind.user_tokens)
            if length > MAX_PROMPT_TOKENS:
                break
            hashes = hashes + [next(ids) for _ in range(-(-length // BLOCK_TOKENS) - len(hashes))]
            output = rng.randint(*output_tokens)
            rows.append(
                {
                    "timestamp": int(at * 1e3),
                    "input_length": length,
                    "output_length": output,
                    "hash_ids": list(hashes),
                }
            )
            if rng.random() > kind.p_continue:
                break
            hashes = hashes[: length // BLOCK_TOKENS]  # the partial last block changes
            length += output
            at += rng.lognormvariate(math.log(kind.think_median_s), 1.5)
    rows.sort(key=lambda r: r["timestamp"])
    return rows[:n]


def _pool(
    kind: Kind, rng: random.Random, ids: itertools.count
) -> tuple[list[list[int]], list[float]]:
    heads = [[next(ids)] for _ in range(kind.heads)]
    prefixes = []
    for _ in range(kind.prefixes):
        head = rng.choice(heads) if heads else []
        prefixes.append(head + [next(ids) for _ in range(rng.randint(*kind.prefix_blocks))])
    weights = [1 / (k + 1) ** kind.zipf for k in range(kind.prefixes)]
    return prefixes, weights


def main(argv: list[str] | None = None) -> int:
    """Write a trace: `python -m kvfabric.deploy.sim.workloads SHAPE N [--seed S]
    [--new-per-s R] [-o PATH]`."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(
        prog="python -m kvfabric.deploy.sim.workloads",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("shape", choices=[s.value for s in Shape])
    ap.add_argument("requests", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--new-per-s", type=float, default=1.0, help="conversations started per second")
    ap.add_argument("-o", "--output", default=None, help="JSONL file (default: stdout)")
    args = ap.parse_args(argv)
    if args.requests < 1 or not args.new_per_s > 0:
        ap.error("requests must be >= 1 and --new-per-s > 0")
    text = "".join(
        json.dumps(r) + "\n"
        for r in generate(Shape(args.shape), args.requests, args.seed, args.new_per_s)
    )
    if args.output is None:
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
