"""Who may touch a node actor's cache, and when.

The node actor is an asyncio actor: its methods run one at a time on the event
loop, and a method that waits on another actor awaits, so exports and control
calls are served meanwhile. A fetch's import is one cache call that spans a read
from a peer, which may take up to the fetch deadline; it runs in a thread so the
loop keeps serving. Two rules keep the cache (not thread-safe) consistent:

- `mutex`: every touch of the cache holds it, and nothing waits while holding it,
  except an import's thread, which gives it up for the length of each read, and a
  save's, which gives it up while it copies the staged bytes into reserved pages.
- `family`: an import's open transaction holds nodes of one prefix family (the
  subtree under its first page); a split or an insert there would invalidate them.
  Calls that change the tree's shape in a family (put, get, export) wait while an
  import of that family is in flight; every other family is served at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, TypeVar

T = TypeVar("T")


class CacheGate:
    def __init__(self) -> None:
        self.mutex = threading.Lock()
        # One import thread: the transport is not thread-safe, and reads are short.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvf-import")
        # One save thread: a save never waits behind a read from a slow peer.
        self._saves = ThreadPoolExecutor(1, thread_name_prefix="kvf-save")
        self._families: dict[bytes, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def family(self, key: bytes | None) -> AsyncIterator[None]:
        """Hold the prefix family of first page key `key` (None: no family)."""
        if key is None:
            yield
            return
        lock, users = self._families.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self._families[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._families[key]
            if users == 1:
                del self._families[key]  # bounded by the calls in flight
            else:
                self._families[key] = (lock, users - 1)

    async def run_import(self, key: bytes | None, work: Callable[[], T]) -> T:
        """Run `work` (one cache call) in the import thread, holding `mutex` there and
        the family on the loop; `released` wraps the reads it makes."""
        return await self._run_locked(self._pool, key, work)

    async def run_save(self, key: bytes | None, work: Callable[[], T]) -> T:
        """As run_import, in the save thread; `released` wraps the copy it makes."""
        return await self._run_locked(self._saves, key, work)

    async def _run_locked(
        self, pool: ThreadPoolExecutor, key: bytes | None, work: Callable[[], T]
    ) -> T:
        async with self.family(key):
            future = asyncio.get_running_loop().run_in_executor(pool, self._locked, work)
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                await asyncio.wait({future})  # the family stays held until the thread is done
                raise

    async def run_wire(self, work: Callable[[], T]) -> T:
        """Run `work` (a transport call, not the cache) in the import thread, so that
        it never overlaps a read."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def _locked(self, work: Callable[[], T]) -> T:
        with self.mutex:
            return work()

    def released(self, read: Callable[..., T]) -> Callable[..., T]:
        """`read`, called with `mutex` given up (by the import thread that holds it)."""

        def call(*args, **kwargs) -> T:
            self.mutex.release()
            try:
                return read(*args, **kwargs)
            finally:
                self.mutex.acquire()

        return call

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._saves.shutdown(wait=False, cancel_futures=True)
