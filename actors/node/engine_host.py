"""What a node actor offers the engines on its host: their KV through shared-memory
staging pages (no bytes through Ray), a watch on their processes, and a place for their
connectors' counters.

The node actor holds one EngineHost and hands it the cache, the gate, how to find a
prefix family and its publish; the engines, their pages and reports are the EngineHost's
own."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Sequence

from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.transport.staging import (
    StagedHit,
    StagingError,
    StagingPages,
    StagingSpec,
    check_spec,
    load_to_staging,
    save_from_staging,
)

from .cache_gate import CacheGate
from .engine_process import MAX_NAME, EngineProcess, EngineProcessError

log = logging.getLogger(__name__)

MAX_ENGINES = 64  # reports kept, newest first: engines restart under new names


class EngineReportError(ValueError):
    """An engine's report that is not names to counters; the kept reports are unchanged."""


def check_report(engine: str, counters: dict) -> dict[str, int | dict[str, int]]:
    """An engine's counters: names to ints, one level of nesting; anything else is refused."""
    if not isinstance(engine, str) or not 0 < len(engine) <= MAX_NAME:
        raise EngineReportError(
            f"engine must be a name of 1..{MAX_NAME} characters, got {engine!r:.80}"
        )
    if not isinstance(counters, dict) or len(counters) > 64:
        raise EngineReportError("counters must be a dict of at most 64 entries")
    out: dict[str, int | dict[str, int]] = {}
    for k, v in counters.items():
        if isinstance(v, dict):
            v = check_report(engine, v)
            if any(isinstance(x, dict) for x in v.values()):
                raise EngineReportError("counters nest one level at most")
        elif type(v) is not int or v < 0:
            raise EngineReportError(f"counter {k!r:.40} must be an int >= 0, got {v!r:.40}")
        if not isinstance(k, str) or not k:
            raise EngineReportError(f"counter names must be non-empty strings, got {k!r:.40}")
        out[k] = v
    return out


# The first page key of `tokens` in `namespace` (the prefix family a call holds), or None.
Family = Callable[[Sequence[int], str], bytes | None]


class EngineHost:
    def __init__(
        self,
        node: str,
        layout: KVLayout,
        cache: NodeCache,
        gate: CacheGate,
        family: Family,
        publish: Callable[[], object],
        after_get: Callable[[NodeCache], None] | None = None,
    ) -> None:
        """`node`: the node actor's name (its engines' records name it); `publish`: sends
        the index what changed (called under the gate's mutex); `after_get`: the node's
        hook, called as a get's is (tests, chaos)."""
        self.node = node
        self.layout = layout
        self.cache = cache
        self.gate = gate
        self.family = family
        self.publish = publish
        self.after_get = after_get
        self._shared: dict[str, StagingPages] = {}  # engines' staging pages, by file prefix
        self._reports: OrderedDict[str, dict] = OrderedDict()
        self._engines: dict[int, EngineProcess] = {}  # by pid: the engines to watch
        self._gone: dict[str, int] = {}  # ended engines' index names -> epoch, until retired

    def adopt_engines(self) -> list[int]:
        """At the actor's start: a restarted actor knew no engine, its engines' records say
        who they were. The ones still running are watched again, the others are reaped at
        the next beat; other nodes' engines that ended lose their staging files. Returns
        the pids adopted."""
        fabric = self.layout.fingerprint.hex()
        for proc in EngineProcess.read_records(self.node, fabric)[:MAX_ENGINES]:
            self._engines[proc.pid] = proc
        freed = EngineProcess.free_dead_staging(self.node, fabric)
        if freed:
            log.info("unlinked the staging files of %d ended engines of other nodes", len(freed))
        return sorted(self._engines)

    def engine_started(self, proc: EngineProcess) -> None:
        """An engine on this host announces itself; what the node keeps for it is dropped
        when its process ends (`reap_engines`). A refused announcement changes nothing."""
        if not isinstance(proc, EngineProcess):
            raise EngineProcessError(f"expected an EngineProcess, got {type(proc).__name__}")
        proc.check(self.node)
        if proc.pid not in self._engines and len(self._engines) >= MAX_ENGINES:
            raise EngineProcessError(f"{MAX_ENGINES} engines are watched already")
        self._engines[proc.pid] = proc
        self._map_early(proc.staging)

    def _map_early(self, spec: StagingSpec) -> None:
        """Map an engine's staging pages now, where its workers made them already:
        mapping faults every page in (about 60 ms for the connector bench's 190 MiB),
        which the engine's first load or save waited out when the node mapped at first
        use. Where they are not there yet, or do not map, the first use maps them."""
        if not all(spec.path(pool).exists() for pool in self.layout.pools):
            return
        try:
            self._staging(spec)
        except (OSError, StagingError) as e:
            log.warning("%s: staging not mapped at the engine's start: %s", spec.prefix, e)

    def reap_engines(self) -> dict[str, int]:
        """Drop the staging pages of engines whose process is gone. Returns every ended
        engine's index name and epoch not yet retired: that life's entries are stale,
        and the directory retires them (`engines_retired` says it did)."""
        for proc in [p for p in self._engines.values() if not p.alive()]:
            del self._engines[proc.pid]
            self.drop_staging(proc.staging)
            for pool in self.layout.pools:  # files the node never mapped too
                proc.staging.path(pool).unlink(missing_ok=True)
            proc.record_path().unlink(missing_ok=True)
            if proc.index_name:
                self._gone[proc.index_name] = max(
                    proc.index_epoch, self._gone.get(proc.index_name, 0)
                )
        return dict(self._gone)

    def engines_retired(self, retired: dict[str, int]) -> None:
        """The directory retired these lives in every shard: stop naming them."""
        for name, epoch in retired.items():
            if self._gone.get(name) == epoch:
                del self._gone[name]

    def watched_engines(self) -> list[int]:
        return sorted(self._engines)

    async def load_staged(
        self,
        spec: StagingSpec,
        tokens: Sequence[int],
        namespace: str,
        skip_pages: int,
        slots: dict[PoolName, list[int]],
    ) -> StagedHit:
        """Copy the usable cached prefix beyond `skip_pages` into the engine's staging pages."""
        async with self.gate.family(self.family(tokens, namespace)):
            with self.gate.mutex:
                hit = load_to_staging(
                    self.cache, self._staging(spec), tokens, namespace, skip_pages, slots
                )
                if self.after_get is not None:
                    self.after_get(self.cache)
                self.publish()
        return hit

    async def save_staged(
        self,
        spec: StagingSpec,
        tokens: Sequence[int],
        namespace: str,
        slots: dict[PoolName, list[int]],
        firsts: dict[PoolName, int],
    ) -> int:
        """Store the whole pages of `tokens` that the engine wrote to its staging pages
        (each pool's from page `firsts[pool]` on: see save_from_staging). The copy runs
        in the save thread without the cache's lock: the loop serves other calls."""
        shared = self._staging(spec)
        stored = await self.gate.run_save(
            self.family(tokens, namespace),
            lambda: save_from_staging(
                self.cache, shared, tokens, namespace, slots, firsts, self.gate.released
            ),
        )
        with self.gate.mutex:
            self.publish()
        return stored

    def drop_staging(self, spec: StagingSpec) -> bool:
        """Unmap an engine's staging pages (the engine is shutting down)."""
        shared = self._shared.pop(check_spec(spec).prefix, None)
        if shared is not None:
            shared.unlink()
        return shared is not None

    def _staging(self, spec: StagingSpec) -> StagingPages:
        """The engine's staging pages, mapped at first use (`spec` comes from outside:
        checked before any file is named from it)."""
        shared = self._shared.get(check_spec(spec).prefix)
        if shared is not None and shared.spec != spec:
            raise StagingError(f"{spec.prefix} is mapped with {shared.spec.pages} pages")
        if shared is None:
            shared = self._shared[spec.prefix] = StagingPages(spec, self.layout)
        return shared

    def engine_report(self, engine: str, counters: dict) -> None:
        """An engine's connector counters so far (cumulative): a report with fewer finished
        requests than the one kept is late and ignored."""
        counters = check_report(engine, counters)
        kept = self._reports.get(engine)
        if kept is not None and kept.get("finished_requests", 0) > counters.get(
            "finished_requests", 0
        ):
            return
        self._reports[engine] = counters
        self._reports.move_to_end(engine)
        while len(self._reports) > MAX_ENGINES:
            self._reports.popitem(last=False)

    def staging_use(self) -> tuple[int, int]:
        """The engines whose staging pages this node maps, and those pages' bytes."""
        mapped = [t for shared in self._shared.values() for t in shared.pools.values()]
        return len(self._shared), sum(t.numel() * t.element_size() for t in mapped)

    def engine_reports(self) -> dict[str, dict]:
        return dict(self._reports)
