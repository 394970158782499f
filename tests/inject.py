"""Raise any exception at any step of a cache operation, by wrapping the
collaborators at the edge of the unit: the reservation hook, the pools'
eviction callbacks, the page copier, the transaction's steps, the page reader,
the checksum function and the lease table. Nothing in core/ knows about it."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Callable, Iterator
from unittest import mock

from kvfabric.core.cache.keys import PageKeyer
from kvfabric.core.cache.leases import LeaseTable
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.radix import RadixTree
from kvfabric.core.cache.txn import Transaction


class Injected(Exception):
    """An exception type no code path expects."""


# Builtins that code on these paths could plausibly raise, and one of our own.
EXCEPTIONS = (
    ValueError,
    KeyError,
    RuntimeError,
    MemoryError,
    OSError,
    IndexError,
    AssertionError,
    ZeroDivisionError,
    Injected,
)


class Step(str, Enum):
    RESERVE = "reserve"  # a reservation point (the cache's reservation hook)
    EVICT = "evict"  # a pool's eviction callback
    COPY = "copy"  # the page copier (write-back, load-back)
    DEFER_COPY = "defer_copy"
    GROW = "grow"  # a new run and its pages (RadixTree.grow: in a transaction, or pure Python)
    WRITE = "write"  # a put's rows into its reserved pages (inside the native insert too)
    KEYS = "keys"  # a new run's page keys (PageKeyer.chain, called by the native insert too)
    PLACE = "place"
    COMMIT = "commit"
    READ = "read"  # the remote-fetch page reader
    CHECKSUM = "checksum"  # page checksums (export and import)
    LEASE = "lease"  # the lease grant of an export


# Steps whose real work can run before the injected exception (the wrapper raises
# after calling through): a commit that finished, or a lease granted, are done.
CAN_RAISE_AFTER = {
    Step.EVICT,
    Step.COPY,
    Step.DEFER_COPY,
    Step.GROW,
    Step.PLACE,
    Step.WRITE,
    Step.KEYS,
    Step.READ,
    Step.CHECKSUM,
}


@dataclass
class Plan:
    step: Step
    at: int  # the at-th call of the step raises (1-based)
    after: bool  # raise after the real call did its work
    exc: type[BaseException]

    def make(self) -> BaseException:
        return self.exc(f"injected at {self.step.value} call {self.at}")


@dataclass
class Injector:
    """Counts calls of one step and raises at the planned one. `final`: whether a
    sealed transaction was open when it raised (its evictions could not be undone)."""

    plan: Plan
    cache: NodeCache
    calls: int = 0
    fired: BaseException | None = None
    final: bool = False
    commits: int = 0
    evicted_at_start: int = field(default=0)

    def wrap(self, real: Callable) -> Callable:
        @functools.wraps(real)
        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == self.plan.at and self.fired is None and not self.plan.after:
                self._raise()
            out = real(*args, **kwargs)
            if self.calls == self.plan.at and self.fired is None and self.plan.after:
                self._raise()
            return out

        return call

    def _raise(self) -> None:
        self.final = any(t.sealed for t in self.cache.open_txns)
        self.fired = self.plan.make()
        raise self.fired

    def evicted(self) -> int:
        return sum(e.evicted for e in self.cache.evictors.values())

    def exact(self) -> bool:
        """Whether the cache must equal its snapshot from before the operation:
        nothing committed, and no transaction failed past a seal that evicted."""
        return self.commits == 0 and not (self.final and self.evicted() > self.evicted_at_start)


@contextlib.contextmanager
def injecting(plan: Plan, cache: NodeCache, leases: LeaseTable | None = None) -> Iterator[Injector]:
    """Install the plan's wrapper on `cache` (and `leases`) for the block."""
    inj = Injector(plan, cache)
    inj.evicted_at_start = inj.evicted()
    real_commit = Transaction.commit

    def counted_commit(txn: Transaction) -> None:
        real_commit(txn)
        inj.commits += 1

    commit = inj.wrap(counted_commit) if plan.step == Step.COMMIT else counted_commit
    tree_type = type(cache.tree)  # the native tree's insert_free is its C base's method
    real_free = tree_type.insert_free

    def counted_free(self, *args):  # an insert on free pages commits when it returns
        done = real_free(self, *args)
        inj.commits += done is not None and done[1] is None
        return done

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(Transaction, "commit", commit))
        stack.enter_context(mock.patch.object(tree_type, "insert_free", counted_free))
        if plan.step == Step.RESERVE:
            stack.enter_context(
                mock.patch.object(cache, "reserve_hook", inj.wrap(lambda pool, tier: None))
            )
        elif plan.step == Step.EVICT:
            wrapped = {pool: inj.wrap(make_room) for pool, make_room in cache.make_room.items()}
            stack.enter_context(mock.patch.dict(cache.make_room, wrapped))
        elif plan.step == Step.COPY:
            copier = SimpleNamespace(copy=inj.wrap(cache.copier.copy))
            stack.enter_context(mock.patch.object(cache, "copier", copier))
        elif plan.step == Step.GROW:
            stack.enter_context(mock.patch.object(RadixTree, "grow", inj.wrap(RadixTree.grow)))
        elif plan.step == Step.WRITE:
            stack.enter_context(mock.patch.object(NodeCache, "_write", inj.wrap(NodeCache._write)))
        elif plan.step == Step.KEYS:
            stack.enter_context(mock.patch.object(PageKeyer, "chain", inj.wrap(PageKeyer.chain)))
        elif plan.step in (Step.DEFER_COPY, Step.PLACE):
            name = plan.step.value
            stack.enter_context(
                mock.patch.object(Transaction, name, inj.wrap(getattr(Transaction, name)))
            )
        elif plan.step == Step.CHECKSUM:
            stack.enter_context(mock.patch.object(cache, "checksums", inj.wrap(cache.checksums)))
        elif plan.step == Step.LEASE and leases is not None:
            stack.enter_context(mock.patch.object(leases, "grant", inj.wrap(leases.grant)))
        yield inj
