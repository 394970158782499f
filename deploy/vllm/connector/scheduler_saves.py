"""The FabricConnector scheduler side's saves: a request's whole pages go from vLLM's
blocks to staging (the worker copies them), then the node actor stores them.

A prompt is saved in the step that computes its last token, a request's pages when it
finishes, each only from the pages the node does not hold yet. The node's store is not
waited for: the engine keeps stepping and the slots come back when the node answers
(past the deadline, when the late call has ended: `StagingSlots.quarantine`). A
request whose prefix a save in flight holds waits for that save (admission answers "not
yet") instead of computing what the node is about to hold.

SchedulerSide holds one: the saves keep their own state (copies and stores in flight,
prompts not saved yet, the copy jobs of this step) and share the side's node link,
staging slots and counters.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from kvfabric.core.cache.layout import PoolName
from kvfabric.transport.staging import StagingSpec

from .jobs import (
    ConnectorStep,
    CopyJob,
    FabricSettings,
    FabricWorkerMeta,
    PoolMove,
    StepHook,
)
from .known_pages import KnownPages
from .node_link import NodeLink
from .plan import NULL_BLOCK, EnginePlan
from .slots import StagingSlots
from .stats import ConnectorStats

log = logging.getLogger(__name__)


@dataclass
class StagedSave:
    """A save the worker is copying to staging, or the node is storing."""

    tokens: list[int]  # those whose KV the engine computed, a partial last page included
    namespace: str
    slots: dict[PoolName, list[int]]
    # Each pool's first staged page: full KV before it is the node's already (or queued
    # to it); SWA KV before it is outside the window vLLM still holds.
    firsts: dict[PoolName, int]
    # The blocks a prompt's save reads while its request runs on: vLLM may hand them to
    # another request meanwhile (a preemption, a sliding window, an abort). An ended
    # request's blocks stay vLLM's until its save is reported, so it reads none at risk.
    reads: frozenset[int] = frozenset()
    hashes: tuple = ()  # vLLM's hashes of its pages: the node holds them once stored


class SchedulerSaves:
    """The scheduler side's saves: what a request's finished prompt and its end store."""

    def __init__(
        self,
        plan: EnginePlan,
        settings: FabricSettings,
        spec: StagingSpec,
        node: NodeLink,
        slots: StagingSlots,
        stats: ConnectorStats,
        step_hook: StepHook | None,
        known: KnownPages,
    ) -> None:
        self.plan = plan
        self.settings = settings
        self.spec = spec
        self.node = node
        self.slots = slots
        self.stats = stats
        self.step_hook = step_hook
        self.known = known  # the pages the node took: stores add to them
        self.saving: dict[str, StagedSave] = {}  # by save job key
        self.copied: dict[str, int] = {}  # save job key -> ranks that copied their heads
        self.storing: list = []  # (call, key, save, deadline): node stores in flight
        # Requests whose prompt is unsaved: its tokens, namespace and vLLM's page hashes.
        self.prompts: dict[str, tuple[list[int], str, tuple]] = {}
        self.jobs: list[CopyJob] = []  # this step's copies to staging, for the workers

    def take_jobs(self) -> list[CopyJob]:
        """This step's copy jobs (FabricMeta.saves); the next step's start empty."""
        jobs, self.jobs = self.jobs, []
        return jobs

    def store_calls(self) -> list:
        """The node stores in flight."""
        return [c for c, *_ in self.storing]

    def save_finished_prompts(self, out, kv_cache_manager: Any, fabric_has: dict[str, int]) -> None:
        """Save each prompt in the step that computes its last token: the worker copies
        after the forward, when the sliding-window blocks of the prompt's last window
        are all still there (decoding moves the window on and vLLM frees them).
        `fabric_has`: the pages the node holds of each request, updated here."""
        if not self.prompts or kv_cache_manager is None:
            return
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, done in computed.items():
            prompt = self.prompts.get(rid)
            if prompt is None or done + out.num_scheduled_tokens.get(rid, 0) < len(prompt[0]):
                continue
            del self.prompts[rid]
            if not self.node.ready() or len(prompt[0]) // self.plan.page_size <= fabric_has.get(
                rid, 0
            ):
                continue
            block_ids = kv_cache_manager.get_blocks(rid).get_block_ids()
            pages = len(prompt[0]) // self.plan.page_size
            if self.save(
                rid,
                f"{rid}/prompt",
                prompt[0],
                prompt[1],
                block_ids,
                pages,
                ends_request=False,
                has=fabric_has.get(rid, 0),
                hashes=prompt[2],
            ):
                fabric_has[rid] = pages  # the end's save copies only what follows

    def in_flight(self, tokens: list[int], namespace: str, skip: int) -> bool:
        """Whether a save the worker copies or the node stores holds page `skip` of
        `tokens` (and so every page before): a request asking for it waits for the
        store rather than compute what the node is about to hold."""
        head = (skip + 1) * self.plan.page_size
        if len(tokens) < head:
            return False
        want = tokens[:head]
        in_flight = itertools.chain(self.saving.values(), (s for _, _, s, _ in self.storing))
        return any(s.namespace == namespace and s.tokens[:head] == want for s in in_flight)

    def reported(self, report: FabricWorkerMeta) -> None:
        """The workers copied these saves to staging (or one failed to): once every
        tensor-parallel rank has copied its heads, the node stores the pages whole."""
        for key in report.failed:
            save = self.saving.pop(key, None)
            self.copied.pop(key, None)
            if save is not None:
                self.stats.save_failures += 1
                self.slots.free(save.slots)
        for key, ranks in report.saved.items():
            if key not in self.saving:
                continue
            copied = self.copied[key] = self.copied.get(key, 0) + ranks
            if copied >= self.plan.ranks:
                del self.copied[key]
                self._store(key, self.saving.pop(key))

    def _store(self, key: str, save: StagedSave) -> None:
        """Ask the node to store staged pages without waiting: the engine keeps stepping,
        and the slots come back when the node answers (collected each step)."""
        try:
            if self.step_hook is not None:
                self.step_hook(ConnectorStep.NODE_SAVE)
            call = self.node.submit(
                "save_staged", self.spec, save.tokens, save.namespace, save.slots, save.firsts
            )
        except Exception as e:
            self._store_failed(key, save, e, None)
            return
        self.storing.append((call, key, save, time.monotonic() + self.settings.timeout_s))

    def collect_stores(self) -> None:
        if not self.storing:
            return
        done = set(self.node.finished([c for c, *_ in self.storing]))
        now, waiting = time.monotonic(), []
        for call, key, save, deadline in self.storing:
            if call in done:
                try:
                    stored = self.node.result(call)
                except Exception as e:
                    self._store_failed(key, save, e, call)
                    continue
                self.slots.free(save.slots)
                self.known.add(save.hashes)
                self.stats.saved_requests += 1
                self.stats.stored_pages += stored
            elif now >= deadline:
                self._store_failed(
                    key, save, TimeoutError(f"no answer in {self.settings.timeout_s} s"), call
                )
            else:
                waiting.append((call, key, save, deadline))
        self.storing = waiting

    def _store_failed(self, key: str, save: StagedSave, error: BaseException, call: Any) -> None:
        # The node may still read the slots (a late call): out of use until it has ended.
        self.stats.save_failures += 1
        self.stats.node_errors += 1
        self.known.forget()
        log.warning("fabric save failed for %s: %r", key, error)
        self.slots.quarantine(save.slots, call)

    def save(
        self,
        rid: str,
        key: str,
        tokens: list[int],
        namespace: str,
        block_ids: tuple[list[int], ...],
        n: int,
        ends_request: bool,
        has: int = 0,
        hashes: tuple = (),
    ) -> bool:
        """Queue the copy of a request's pages to staging, up to page n: full KV from
        page `has` on (the node holds or is storing those before it: a conversation's
        next turn copies its new pages, not the whole conversation again), SWA where
        vLLM still holds it. The node stores them when the worker reports the copy done."""
        n = min([n] + [len(block_ids[g]) for g in range(len(self.plan.group_pools))])
        if n == 0:
            return False
        start = {PoolName.FULL: min(has, n), PoolName.SWA: self._surviving_window(block_ids, n)}
        first_of = {p: start[p] for p in self.plan.layout.pools}
        want = {p: n - first_of[p] for p in self.plan.layout.pools}
        slots = self.slots.alloc(want)
        if slots is None:
            return False
        job = CopyJob(rid, [], key=key, ends_request=ends_request)
        for pool, pool_slots in slots.items():
            first = first_of[pool]
            job.moves.append(
                PoolMove(
                    pool,
                    pool_slots,
                    {g: list(block_ids[g][first:n]) for g in self.plan.groups_of(pool)},
                )
            )
        # The computed tokens as they are: ending on a page, the node keeps the window a
        # repeat of them needs too (NodeCache.put); cut short here, they end on one.
        kept = (
            tokens if n == len(tokens) // self.plan.page_size else tokens[: n * self.plan.page_size]
        )
        reads = frozenset(
            b
            for move in job.moves
            for ids in move.blocks.values()
            for b in ids
            if b >= 0 and b != NULL_BLOCK  # every request's SWA lists name the null block
        )
        self.saving[key] = StagedSave(
            kept, namespace, slots, first_of, frozenset() if ends_request else reads, hashes[:n]
        )
        self.jobs.append(job)
        return True

    def overwrites(self, out) -> bool:
        """Whether this step gives a request a block that a prompt's save started at an
        earlier step still reads: its forward may write it, so the save must end first
        (FabricMeta.fence). vLLM lists every block it hands out in the step's output."""
        reading = frozenset().union(*(s.reads for s in self.saving.values()))
        if not reading:
            return False
        given = [ids for r in out.scheduled_new_reqs for ids in r.block_ids]
        given += [ids for new in out.scheduled_cached_reqs.new_block_ids if new for ids in new]
        return any(not reading.isdisjoint(ids) for ids in given)

    def _surviving_window(self, block_ids: tuple[list[int], ...], n: int) -> int:
        """The first page from which every SWA group still holds its blocks up to n."""
        first = 0
        for g in self.plan.groups_of(PoolName.SWA):
            ids = block_ids[g][:n]
            for p in range(n - 1, -1, -1):
                if ids[p] == NULL_BLOCK:
                    first = max(first, p + 1)
                    break
        return first
