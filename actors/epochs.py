"""Epochs: numbers that strictly increase across restarts, with no clock.

A publisher's epoch (a node actor's, an engine's) orders what it publishes against what
earlier lives of the same identity published: the index keeps the higher epoch and
refuses the lower. A wall clock can step back, so epochs come from Ray's GCS key-value
store instead. It outlives every actor of the cluster, the directory and the index
shards included (with GCS fault tolerance it survives the GCS too), so it remembers
every epoch anything else can remember.

One counter serves every identity: an epoch above all earlier claims of anyone is above
all earlier claims of its identity, and the store then holds one key, not one per life
(engine identities carry a replica id, so every replica restart is a new identity).

The store offers put-if-absent, list and delete, not compare-and-swap, so the counter
is a key per number. A claim lists the numbers and puts the one above the highest; it
holds only if, listed again, its number is still the highest (a racing claim may have
deleted a number the first listing saw, which put-if-absent then hands out twice: the
second listing shows the later claim's higher number and the loser retries). The winner
deletes the numbers below its own; a loser deletes its own. So a number is only deleted
while a higher one is stored, the highest ever accepted is always stored, and a claim
that starts after another returned lists a number at least as high and ends higher."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

NAMESPACE = "kvfabric"
PREFIX = b"epoch/"


class KV(Protocol):
    def put(self, key: bytes, value: bytes, overwrite: bool) -> bool:
        """Store (unless the key exists and not `overwrite`); whether it existed."""

    def keys(self, prefix: bytes) -> list[bytes]: ...

    def delete(self, key: bytes) -> None: ...


class EpochSource(Protocol):
    def claim(self) -> int: ...


def claim_epoch(kv: KV) -> int:
    """An epoch above every epoch claimed before this call began, and no other claim's."""
    while True:
        epoch = max(_numbers(kv.keys(PREFIX)), default=0) + 1
        if kv.put(_key(epoch), b"", False):
            continue  # a racing claim put it first
        stored = _numbers(kv.keys(PREFIX))
        if max(stored) > epoch:  # a racing claim holds a higher one: ours is not the top
            kv.delete(_key(epoch))
            continue
        for old in stored:
            if old < epoch:
                kv.delete(_key(old))
        return epoch


def _key(epoch: int) -> bytes:
    return PREFIX + str(epoch).encode()


def _numbers(keys: list[bytes]) -> list[int]:
    """The numbers under PREFIX; keys of another shape (an older release's per-identity
    `epoch/<name>/<n>`) are ignored, never deleted by mistake for a number."""
    out = []
    for key in keys:
        tail = key[len(PREFIX) :]
        if key.startswith(PREFIX) and tail.isdigit():
            out.append(int(tail))
    return out


class GcsKV:
    """Ray's GCS key-value store (usable in any process connected to the cluster)."""

    def put(self, key: bytes, value: bytes, overwrite: bool) -> bool:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_put(key, value, overwrite, namespace=NAMESPACE)

    def keys(self, prefix: bytes) -> list[bytes]:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_list(prefix, namespace=NAMESPACE)

    def delete(self, key: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=NAMESPACE)


@dataclass(frozen=True)
class GcsEpochs:
    """The default epoch source of node actors and engines."""

    def claim(self) -> int:
        return claim_epoch(GcsKV())
