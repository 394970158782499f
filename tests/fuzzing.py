"""Shared pieces of the decoder fuzz tests (tests/actors/test_fuzz_events.py,
tests/core/test_fuzz_exchange.py, tests/deploy/test_fuzz_files.py): value strategies
near the valid ones, structure mutations, bit flips, and the `fuzz` settings (the
profile's count, or 10,000 cases with KVF_HYPOTHESIS=full).

Each decoder gets random bytes or structures, and valid encodings with one part of them
replaced, deleted or added (bit flips and truncation for bytes). It must either return
exactly what was encoded or raise its own error type, never KeyError, TypeError or a
msgpack exception, and a rejection must leave the consumer (an index shard, a cache)
as it was. Whether a structure is valid is decided by an oracle written from the
format's spec (in each test module), so a decoder that lets a bad field through fails too.

Marked `fuzz`: the profile's example count by default (40 under CI), 10,000 per test with
`KVF_HYPOTHESIS=full .venv/bin/pytest -m fuzz tests`."""

from __future__ import annotations

import copy
import os
from typing import Any, Callable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ_FULL = 10_000


def fuzz(test: Callable) -> Callable:
    """FUZZ_FULL cases under KVF_HYPOTHESIS=full, else the active profile's count."""
    full = os.environ.get("KVF_HYPOTHESIS") == "full"
    return settings(
        max_examples=FUZZ_FULL if full else settings.default.max_examples,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )(test)


# --- values and mutations ------------------------------------------------------------------
U64 = st.integers(0, 2**64 - 1)
KEY = st.binary(min_size=16, max_size=16)
FP = b"F" * 16  # the layout fingerprint of the index and caches below
# Values near the valid ones of every field: edge ints, bools, floats, short and 15..17-byte
# bytes, the format's own words, small containers.
NEAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 20),
    st.sampled_from([-(2**63), 2**63 - 1, 2**64 - 1, 1024, 1025]),
    st.floats(),
    st.text(max_size=4),
    st.sampled_from(["batch", "snapshot", "full", "swa", "float32", "x" * 257]),
    st.binary(max_size=3),
    st.binary(min_size=15, max_size=17),
    st.just(FP),
    st.lists(st.integers(-1, 2), max_size=3),
    st.lists(st.sampled_from(["full", "swa", "moe"]), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 2), max_size=2),
)


def typed(old: Any) -> st.SearchStrategy:
    """A value of the type of `old`: more mutants get past the decoder, on to its consumer."""
    if isinstance(old, bool):
        return st.booleans()
    if isinstance(old, int):
        return st.integers(0, 40) | st.sampled_from([old - 1, min(old + 1, 2**64 - 1), 2**64 - 1])
    if isinstance(old, bytes):
        return KEY | st.sampled_from([FP, old[:-1] + bytes([old[-1] ^ 1]) if old else b"x"])
    return NEAR


# What JSON can carry (trace lines): no bytes; floats may be NaN or infinite.
NEAR_JSON = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 2000),
    st.just(2**70),
    st.floats(),
    st.text(max_size=4),
    st.lists(st.integers(-1, 3) | st.booleans() | st.floats(), max_size=5),
    st.dictionaries(st.text(max_size=3), st.integers(0, 2), max_size=2),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=20),
    KEY,
)
RANDOM = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=8)
        | st.dictionaries(st.text(max_size=6) | st.binary(max_size=4), inner, max_size=6)
    ),
    max_leaves=24,
)


def _paths(x: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, at + (i,))
    elif isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, at + (k,))
    return out


@st.composite
def mutated(
    draw: st.DrawFn,
    x: Any,
    values: st.SearchStrategy | Callable[[Any], st.SearchStrategy] = NEAR,
    new_keys: st.SearchStrategy = st.text(max_size=4),
    root: bool = True,
    ops: tuple[str, ...] = ("replace", "delete", "insert"),
) -> Any:
    """`x` (nested lists and dicts) with one node replaced, deleted, or a sibling inserted;
    the whole of it replaced too, with `root`. `values` may be a function of the value replaced."""
    x = copy.deepcopy(x)
    pick = (lambda _: values) if isinstance(values, st.SearchStrategy) else values
    path = draw(st.sampled_from(_paths(x)[0 if root else 1 :]))
    if not path:
        return draw(pick(x))
    parent = x
    for step in path[:-1]:
        parent = parent[step]
    op = draw(st.sampled_from(ops))
    if op == "replace":
        parent[path[-1]] = draw(pick(parent[path[-1]]))
    elif op == "delete":
        del parent[path[-1]]
    elif isinstance(parent, list):
        parent.insert(path[-1], draw(pick(None)))
    else:
        parent[draw(new_keys)] = draw(pick(None))
    return x


@st.composite
def flipped(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` after 1-3 bit flips, truncations, insertions or deletions."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(out)))
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        if op == "flip" and i < len(out):
            out[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del out[i:]
        elif op == "insert":
            out[i:i] = draw(st.binary(min_size=1, max_size=4))
        else:
            del out[i : i + draw(st.integers(1, 4))]
    return bytes(out)


def _uint(x: object) -> bool:
    return type(x) is int and x >= 0


def _pos(x: object) -> bool:
    return type(x) is int and x > 0
