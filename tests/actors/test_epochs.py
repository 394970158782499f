"""Epoch claims (actors/epochs.py) over a key-value store with put-if-absent, list and
delete: a claim that starts after another returned is higher, concurrent ones are
distinct, and the store holds a bounded number of keys however many lives claimed."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st
from kvfabric.actors.epochs import PREFIX, claim_epoch


class DictKV:
    """The GCS store's contract, in memory: each call is atomic, none more than one.
    `hook` runs before every call (a racing claim's window)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.lock = threading.Lock()
        self.hook = lambda: None

    def put(self, key: bytes, value: bytes, overwrite: bool) -> bool:
        self.hook()
        with self.lock:
            existed = key in self.data
            if overwrite or not existed:
                self.data[key] = value
            return existed

    def keys(self, prefix: bytes) -> list[bytes]:
        self.hook()
        with self.lock:
            return [k for k in self.data if k.startswith(prefix)]

    def delete(self, key: bytes) -> None:
        self.hook()
        with self.lock:
            self.data.pop(key, None)


@given(st.lists(st.dictionaries(st.integers(0, 8), st.integers(1, 3)), max_size=25))
def test_each_claim_is_above_every_claim_that_returned_before_it(plans):
    """Each plan races claims into one claim: before its i-th store call, n others run to
    completion (taking the number it listed, deleting what it saw). Every claim is distinct,
    and above every claim that returned before it began; one key stays stored."""
    kv = DictKV()
    returned: list[int] = []
    for plan in plans:
        before = max(returned, default=0)
        calls = 0

        def race(plan=plan) -> None:
            nonlocal calls
            n = plan.get(calls, 0)
            calls += 1
            if n:
                kv.hook = lambda: None
                returned.extend(claim_epoch(kv) for _ in range(n))
                kv.hook = race

        kv.hook = race
        epoch = claim_epoch(kv)
        kv.hook = lambda: None
        assert epoch > before
        returned.append(epoch)
        assert len(returned) == len(set(returned)), returned
        assert len(kv.keys(PREFIX)) == 1


def test_concurrent_claims_are_distinct_and_rise_for_each_claimer():
    kv = DictKV()
    got: list[list[int]] = [[] for _ in range(6)]

    def claimer(out: list[int]) -> None:
        for _ in range(50):
            out.append(claim_epoch(kv))

    threads = [threading.Thread(target=claimer, args=(out,)) for out in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    flat = [e for out in got for e in out]
    assert len(flat) == len(set(flat)) == 300
    assert all(out == sorted(out) for out in got)
    assert claim_epoch(kv) > max(flat)
    assert len(kv.keys(PREFIX)) == 1


def test_ten_thousand_lives_leave_one_key():
    kv = DictKV()
    epochs = [claim_epoch(kv) for _ in range(10_000)]
    assert epochs == sorted(set(epochs))
    assert kv.keys(PREFIX) == [PREFIX + str(epochs[-1]).encode()]


def test_keys_of_another_shape_are_neither_counted_nor_deleted():
    """An older release's per-identity keys (`epoch/<name>/<n>`, the hint `epoch/<name>`)."""
    kv = DictKV()
    old = [b"epoch/node-1/7", b"epoch/node-1", b"epoch/99x"]
    for key in old:
        kv.put(key, b"7", True)
    assert claim_epoch(kv) == 1
    assert claim_epoch(kv) == 2
    assert sorted(kv.keys(PREFIX)) == sorted([*old, b"epoch/2"])
