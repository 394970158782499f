"""The FabricConnector's scheduler side (vLLM's EngineCore process).

One Ray call to the node actor per request and operation: at admission it asks for
the usable cached prefix beyond vLLM's own hit and has it copied into staging slots,
without waiting on it past `lookup_wait_s`: vLLM asks again at its next steps (the
answer None) until the node answered or the call's deadline passed, so the engine's
loop never waits a node's copy out (then the worker copies slots into the request's
blocks, asynchronously for vLLM:
the request waits in WAITING_FOR_REMOTE_KVS, and a failed copy is reported as a
failed receive, which vLLM recomputes). When a request finishes, its whole pages are
copied by the worker into staging, and the node actor stores them (scheduler_saves.py,
a collaborator the side holds, as it holds its staging slots: slots.py).

Before that load, a prefix another node holds longer is first fetched into the node
(remote_fetch.py): the request waits unscheduled meanwhile, the engine keeps stepping.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvfabric.core.cache.layout import PoolName
from kvfabric.deploy.vllm.events.index_sink import FeedSpec
from kvfabric.deploy.vllm.events.namespaces import RequestNamespaces
from kvfabric.transport.staging import StagedHit, StagingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .jobs import ConnectorStep, CopyJob, FabricMeta, FabricSettings, FabricWorkerMeta, PoolMove
from .known_pages import KnownPages
from .node_link import NodeLink
from .plan import NULL_BLOCK, EnginePlan
from .remote_fetch import RemoteFetches
from .scheduler_saves import SchedulerSaves
from .slots import StagingSlots
from .stats import ConnectorStats

log = logging.getLogger(__name__)


@dataclass
class _Asked:
    """A load call the node has not answered yet (its slots are the node's meanwhile)."""

    call: Any
    skip: int  # vLLM's own hit (pages) it was asked for
    slots: dict[PoolName, list[int]]
    deadline: float


@dataclass
class _Load:
    hit: StagedHit
    skip: int  # vLLM's own hit (pages) it was planned for
    slots: dict[PoolName, list[int]] = field(default_factory=dict)
    # Tokens by where they came from, counted once the worker says the copy succeeded.
    tokens: int = 0
    remote_tokens: int = 0
    host_tokens: int = 0
    hashes: tuple = ()  # vLLM's hashes of the hit's pages: the node holds them once loaded


class SchedulerSide:
    def __init__(
        self,
        plan: EnginePlan,
        settings: FabricSettings,
        spec: StagingSpec,
        feed: FeedSpec | None = None,
        namespaces: RequestNamespaces | None = None,
        hash_block_size: int | None = None,
    ) -> None:
        self.plan = plan
        self.namespaces = namespaces or RequestNamespaces()
        self.request_ns: dict[str, str | None] = {}  # each live request's, computed once
        self.settings = settings
        self.step_hook = settings.make_step_hook()  # tests, chaos: fail a load or save here
        self.spec = spec
        self.node = NodeLink(settings, plan.layout, feed, spec)
        self.slots = StagingSlots(spec, plan.layout.pools)
        self.window_pages = plan.layout.window_pages
        self.asked: dict[str, _Asked] = {}  # load calls in flight, by request
        self.planned: dict[str, _Load] = {}  # admitted lookups, before block allocation
        self.loading: dict[str, _Load] = {}  # copies the worker has not reported yet
        # Usable pages the node said it holds for a request at admission: a save of no
        # more than that copies nothing.
        self.fabric_has: dict[str, int] = {}
        self.known = KnownPages(plan.page_size, hash_block_size)
        self.kv_cache_manager = None
        self.no_load: set[str] = set()  # a load failed: recompute, never retry
        self.meta = FabricMeta()
        self.stats = ConnectorStats()
        self.saves = SchedulerSaves(
            plan, settings, spec, self.node, self.slots, self.stats, self.step_hook, self.known
        )
        self.report_due = False  # requests finished since the node last heard the counters
        self.remote = RemoteFetches(self.node, settings, self.stats.remote)
        self.hit_sources: dict[str, dict[CacheHitSource, int]] = {}  # the last load's, per request

    # --- admission -------------------------------------------------------------------
    def num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens the fabric will load, True), (0, False) for none, or (None, False)
        while another node's prefix is being fetched (vLLM asks again next step)."""
        rid = request.request_id
        ps = self.plan.page_size
        skip = num_computed_tokens // ps
        # vLLM asks again at each step a request waits for room: an answer for the same
        # own hit stands (its pages are staged already), a call per step would block the
        # engine's loop on the node actor each time.
        load = self.planned.get(rid)
        if load is not None and load.skip == skip:
            return (load.hit.pages - skip) * ps, True
        asked = self.asked.get(rid)
        if asked is not None:
            return self._answered(request, asked, skip)
        self._drop_plan(rid)
        namespace = self._namespace(request)
        if (
            namespace is None
            or rid in self.no_load
            or not self.node.ready()
            or self.fabric_has.get(rid, skip + 1) <= skip
        ):
            return 0, False
        tokens = list(request.prompt_token_ids or [])[:-1]  # vLLM computes >= 1 token itself
        need = len(tokens) // ps - skip
        if need <= 0:
            # vLLM's own cache holds the prompt: the node is not asked, and its save
            # copies only the pages this engine has not seen the node take.
            prompt_pages = len(request.prompt_token_ids or ()) // ps
            known = self.known.leading(self._hashes(request, prompt_pages))
            if known:
                self.fabric_has[rid] = known
            return 0, False
        if self.saves.in_flight(tokens, namespace, skip):
            # The node runs calls concurrently: its match may answer before the store
            # ends, so a lookup made meanwhile is made again once it has.
            self.remote.forget_lookup(rid)
            return None, False
        if not self.remote.ready(rid, tokens, namespace, skip):
            return None, False
        self.stats.lookups += 1
        held = self.remote.node_holds(rid)
        if held is not None and held <= skip:
            # The lookup already asked the node: a load call would find nothing, and it
            # would wait in the node actor's queue behind other engines' saves.
            self.fabric_has[rid] = held
            self.stats.lookups_answered_by_match += 1
            return 0, False
        want = {
            p: need if p == PoolName.FULL else min(need, self.window_pages)
            for p in self.plan.layout.pools
        }
        slots = self.slots.alloc(want)
        if slots is None:
            return 0, False
        try:
            if self.step_hook is not None:
                self.step_hook(ConnectorStep.NODE_LOAD)
            call = self.node.submit("load_staged", self.spec, tokens, namespace, skip, slots)
        except Exception as e:  # any failure: this request computes its prefix itself
            self._load_failed(rid, slots, None, e)
            return 0, False
        asked = self.asked[rid] = _Asked(
            call, skip, slots, time.monotonic() + self.settings.timeout_s
        )
        # A node answers in milliseconds when idle: worth that wait, not an engine step.
        self.remote.wait_for([call], self.settings.lookup_wait_s)
        return self._answered(request, asked, skip)

    def _answered(self, request, asked: _Asked, skip: int) -> tuple[int | None, bool]:
        """The admission's answer once its load call has ended (None before, until the
        deadline: then the request computes, and the call keeps its slots until it ends)."""
        rid = request.request_id
        if not self.node.finished([asked.call]):
            if time.monotonic() < asked.deadline:
                return None, False
            del self.asked[rid]
            self._load_failed(rid, asked.slots, asked.call, TimeoutError("past its deadline"))
            return 0, False
        del self.asked[rid]
        try:
            hit = self.node.result(asked.call)
        except Exception as e:  # any failure: this request computes its prefix itself
            self._load_failed(rid, asked.slots, asked.call, e)
            return 0, False
        self.fabric_has[rid] = hit.pages
        if hit.pages <= skip or asked.skip != skip:
            # Nothing to load, or vLLM's own hit changed meanwhile: staged for another
            # hit, asked again for this one.
            self.slots.free(asked.slots)
            if hit.pages <= skip:
                return 0, False
            return self.num_new_matched_tokens(request, skip * self.plan.page_size)
        self.slots.free({p: s[len(hit.slots.get(p, [])) :] for p, s in asked.slots.items()})
        self.planned[rid] = _Load(hit, skip, hit.slots, hashes=self._hashes(request, hit.pages))
        return (hit.pages - skip) * self.plan.page_size, True

    def _load_failed(self, rid: str, slots, call: Any, e: BaseException) -> None:
        self.stats.node_errors += 1
        self.known.forget()
        log.warning("fabric lookup failed for %s: %r", rid, e)
        self.slots.quarantine(slots, call)

    def after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        load = self.planned.pop(rid, None)
        if load is None:
            return
        if num_external_tokens == 0:
            self.slots.free(load.slots)
            return
        hit = load.hit
        block_ids = blocks.get_block_ids()
        job = CopyJob(rid, [])
        for pool, slots in load.slots.items():
            first = hit.firsts[pool]
            per_group = {}
            for g in self.plan.groups_of(pool):
                ids = list(block_ids[g][first : first + len(slots)])
                per_group[g] = [-1 if b == NULL_BLOCK else b for b in ids]
                if any(b != NULL_BLOCK for b in block_ids[g][hit.first_page : first]):
                    job.doomed = f"vLLM wants {pool.name} KV before the pages the fabric holds"
            job.moves.append(PoolMove(pool, slots, per_group))
        if (
            hit.pages * self.plan.page_size
            != num_external_tokens + hit.first_page * self.plan.page_size
        ):
            job.doomed = job.doomed or "vLLM admitted a different number of tokens than offered"
        self.meta.loads.append(job)
        ps = self.plan.page_size
        remote = min(
            self.remote.fetched_pages(rid, hit.pages, hit.first_page) * ps, num_external_tokens
        )
        load.tokens, load.remote_tokens = num_external_tokens, remote
        load.host_tokens = min(hit.host_pages * ps, num_external_tokens - remote)
        self.loading[rid] = load
        # vLLM's metrics split cached tokens by source: fetched ones as P2P, the rest HOST.
        self.hit_sources[rid] = {
            s: n
            for s, n in (
                (CacheHitSource.P2P, remote),
                (CacheHitSource.HOST, num_external_tokens - remote),
            )
            if n
        }

    # --- each step ---------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        namespace = self._namespace(request)
        if namespace is not None:
            prompt = list(request.prompt_token_ids or [])
            hashes = self._hashes(request, len(prompt) // self.plan.page_size)
            self.saves.prompts[request.request_id] = (prompt, namespace, hashes)

    def hit_sources_of(self, request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        sources = self.hit_sources.pop(request.request_id, {})
        return (
            sources
            if sum(sources.values()) == num_external_tokens
            else ({CacheHitSource.HOST: num_external_tokens} if num_external_tokens else {})
        )

    def build_meta(self, scheduler_output) -> FabricMeta:
        waited = [a.call for a in self.asked.values()] + self.saves.store_calls()
        self.remote.wait_if_idle(scheduler_output.total_num_scheduled_tokens, waited)
        self.saves.collect_stores()
        fence = self.saves.overwrites(scheduler_output)  # before this step's own saves join
        self.saves.save_finished_prompts(scheduler_output, self.kv_cache_manager, self.fabric_has)
        meta, self.meta = self.meta, FabricMeta()
        meta.saves = self.saves.take_jobs()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        meta.fence = fence
        self.slots.release(self.node)
        return meta

    def on_output(self, output) -> None:
        failed_loads = set(getattr(output, "failed_recving", None) or ())
        for rid in output.finished_recving or ():
            load = self.loading.pop(rid, None)
            if load is not None:
                self.slots.free(load.slots)
            if rid in failed_loads:
                self.no_load.add(rid)
                self.stats.load_failures += 1
            elif load is not None:
                self.known.add(load.hashes)
                self.stats.loaded_tokens += load.tokens
                self.stats.remote_loaded_tokens += load.remote_tokens
                self.stats.host_loaded_tokens += load.host_tokens
        report = output.kv_connector_worker_meta
        if isinstance(report, FabricWorkerMeta):
            self.saves.reported(report)

    # --- finish ------------------------------------------------------------------------
    def finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """Save the whole pages of the finished request (its full KV; SWA only where
        vLLM still holds it). True: vLLM keeps the blocks until the worker copied them."""
        rid = request.request_id
        self._drop_plan(rid)
        self.no_load.discard(rid)
        self.saves.prompts.pop(rid, None)
        self.remote.forget(rid)
        self.hit_sources.pop(rid, None)
        has = self.fabric_has.pop(rid, 0)
        namespace = self._namespace(request)
        self.request_ns.pop(rid, None)
        self.stats.finished_requests += 1
        if not self.node.ready():
            return False, None
        self.report_due = True
        # The tokens whose KV was computed: the last sampled one has none yet.
        tokens = list(request.all_token_ids)[: request.num_computed_tokens]
        n = len(tokens) // self.plan.page_size
        if n <= has or namespace is None:
            return False, None
        hashes = self._hashes(request, n)
        return self.saves.save(
            rid, f"{rid}/end", tokens, namespace, block_ids, n, True, has, hashes
        ), None

    def send_report(self) -> None:
        """The counters to the node, once a step in which requests finished (not once a
        request: a step that ends 16 spent 5 ms on reports)."""
        if not self.report_due or not self.node.ready():
            return
        self.report_due = False
        self.stats.quarantined_slots = self.slots.quarantined_count()
        self.node.report(self.spec.prefix, self.stats)

    def shutdown(self) -> None:
        """The engine is going: its node unmaps the staging pages, and the files go (the
        worker unlinks them too, unless it was killed: vLLM then ends the engine cleanly
        here, and a record gone with its files left would leave them for no one to reap)."""
        if self.node.actor is not None:
            self.node.tell("drop_staging", self.spec)
        for pool in self.plan.layout.pools:
            self.spec.path(pool).unlink(missing_ok=True)
        if self.node.record is not None:
            self.node.record.unlink(missing_ok=True)  # a clean stop: nothing to reap

    def _hashes(self, request, pages: int) -> tuple:
        """vLLM's hashes that end the request's first `pages` pages (known_pages.py)."""
        return self.known.of(getattr(request, "block_hashes", ()), pages)

    # --- namespaces --------------------------------------------------------------------
    def _namespace(self, request) -> str | None:
        """The request's namespace (events/namespaces.py), once per request; None: never cached."""
        rid = request.request_id
        if rid in self.request_ns:
            return self.request_ns[rid]
        namespace = self.request_ns[rid] = self.namespaces.of(request)
        if namespace is None:
            self.stats.uncacheable_requests += 1
        return namespace

    # --- plans ----------------------------------------------------------------------
    def _drop_plan(self, rid: str) -> None:
        load = self.planned.pop(rid, None)
        if load is not None:
            self.slots.free(load.slots)
        asked = self.asked.pop(rid, None)
        if asked is not None:  # the node may still write them: back once the call ended
            self.slots.quarantine(asked.slots, asked.call)
