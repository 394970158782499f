"""Epochs of node identities: strictly increasing across restarts, with no clock.

A node actor's epoch orders what it publishes against what earlier lives of the
same identity (its actor name) published: the index keeps the higher epoch and
refuses the lower. A wall clock can step back, so epochs come from Ray's GCS
key-value store instead. It outlives every actor of the cluster, the directory
and the index shards included (with GCS fault tolerance it survives the GCS too),
so it remembers every epoch anything else can remember. A claim takes the next
number by put-if-absent: no two claims get one epoch, and a later claim always
gets a higher one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

NAMESPACE = "kvfabric"


class KV(Protocol):
    def get(self, key: bytes) -> bytes | None: ...

    def put(self, key: bytes, value: bytes, overwrite: bool) -> bool:
        """Store (unless the key exists and not `overwrite`); whether it existed."""


class EpochSource(Protocol):
    def claim(self, identity: str) -> int: ...


def claim_epoch(kv: KV, identity: str) -> int:
    """The next epoch of `identity`: above every epoch claimed for it before.

    Claims are contiguous (each takes the first number no one holds), so the first
    free number is above all taken ones; the hint only saves scanning from 1, and a
    hint left behind by a racing claim costs a few failed puts, never a repeat."""
    hint = kv.get(_key(identity))
    epoch = int(hint) if hint else 0
    while True:
        epoch += 1
        if not kv.put(_key(identity, epoch), b"", False):
            kv.put(_key(identity), str(epoch).encode(), True)
            return epoch


def _key(identity: str, epoch: int | None = None) -> bytes:
    return f"epoch/{identity}".encode() if epoch is None else f"epoch/{identity}/{epoch}".encode()


class GcsKV:
    """Ray's GCS key-value store (usable in any process connected to the cluster)."""

    def get(self, key: bytes) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(key, namespace=NAMESPACE)

    def put(self, key: bytes, value: bytes, overwrite: bool) -> bool:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_put(key, value, overwrite, namespace=NAMESPACE)


@dataclass(frozen=True)
class GcsEpochs:
    """The default epoch source of node actors."""

    def claim(self, identity: str) -> int:
        return claim_epoch(GcsKV(), identity)
