"""FabricConnector: the fabric as the KV layer of a vLLM engine (vLLM's KV connector API).

Load it with `kv_transfer_config(...)` below, i.e. kv_connector="FabricConnector",
kv_connector_module_path="kvfabric.deploy.vllm.connector", kv_role="kv_both".
It supports the hybrid allocator (SupportsHMA), so full and sliding-window layers keep
separate KV cache groups, and they land in the fabric's FULL and SWA pools.

At the engine's start the scheduler side establishes the engine's KV identity
(kv_identity.py) and connects to the fabric of that identity, starting it if none runs
(node_link.py); what it cannot serve correctly fails the start with the reason
(plan.py, kv_identity.py). Workers learn their tensor-parallel rank and copy their
own KV heads of each page.
"""

from __future__ import annotations

from typing import Any

from kvfabric.deploy.vllm.events.index_sink import FeedSpec
from kvfabric.deploy.vllm.events.namespaces import RequestNamespaces
from kvfabric.transport.staging import StagingSpec, check_space
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .block_format import BlockFormat
from .jobs import FabricMeta, FabricSettings
from .kv_identity import KVIdentity
from .metrics import FabricPromMetrics, FabricStats, StatsReader
from .plan import plan_from_kv_cache_config
from .scheduler_side import SchedulerSide
from .worker_side import WorkerSide

MODULE = __name__.rpartition(".")[0]  # vLLM imports the package: it exports FabricConnector


def kv_transfer_config(node_actor: str, ray_address: str = "", **settings: Any) -> dict:
    """The `kv_transfer_config` that loads this connector for the node's actor."""
    extra = {"node_actor": node_actor, "ray_address": ray_address, **settings}
    FabricSettings.from_extra(extra).make_step_hook()  # fail here, not in the engine process
    return {
        "kv_connector": "FabricConnector",
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
        # A failed load becomes recomputation, never a failed request.
        "kv_load_failure_policy": "recompute",
    }


class FabricConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.settings = FabricSettings.from_extra(tc.kv_connector_extra_config)
        self.plan = plan_from_kv_cache_config(kv_cache_config, vllm_config)
        # Every side (a process each) names the same staging files after the engine.
        spec = StagingSpec(f"kvf-vllm-{tc.engine_id}", self.settings.staging_pages)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.stats_reader = StatsReader()  # what get_kv_connector_stats reported last
        if role == KVConnectorRole.SCHEDULER:
            # The workers reserve the staging files (posix_fallocate); say first, and in
            # full, what /dev/shm lacks for them.
            check_space(spec, self.plan.layout)
            identity = KVIdentity.of(vllm_config, self.settings.model_digest)
            self.plan = self.plan.with_tag(identity.tag())
            namespaces = RequestNamespaces()
            feed = FeedSpec.of(
                vllm_config.kv_events_config,
                self.settings.engine_slot,
                self.plan.group_pools,
                namespaces.adapter_named,
            )
            self.scheduler = SchedulerSide(
                self.plan,
                self.settings,
                spec,
                feed,
                namespaces,
                getattr(kv_cache_config, "hash_block_size", None),
            )
            self.scheduler.node.served = _served_name(vllm_config.model_config)
            self.scheduler.node.start()
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank() if self.plan.ranks > 1 else 0
            self.worker = WorkerSide(self.plan, self.settings, spec, rank)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def _worker(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("FabricConnector: a worker call on the scheduler's connector")
        return self.worker

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("FabricConnector: a scheduler call on a worker's connector")
        return self.scheduler

    # --- worker side -----------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        # Asked here, once the model's layers exist: their backends say how K and V sit.
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        backends = get_current_attn_backends(self._vllm_config, list(kv_caches))
        self._worker().register(kv_caches, BlockFormat.of_backends(b.get_name() for b in backends))

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # vLLM calls this before every forward (start_load_kv comes after it when loads
        # are asynchronous): the last point where a prompt's save may still read blocks
        # vLLM handed to another request at this step's scheduling.
        assert isinstance(kv_connector_metadata, FabricMeta)
        self._worker().before_forward(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FabricMeta)
        self._worker().start_load(meta)

    def has_connector_metadata(self) -> bool:
        # vLLM asks this around every attention layer, to call the layer hooks below: they
        # do nothing here (a step's copies run in the worker's copy thread), so no layer
        # pays for them. The step hooks read the metadata as they are bound to it.
        return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a load's request waits outside the batch until its copy is reported

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saves copy finished requests' blocks once, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FabricMeta)
        self._worker().save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._worker().transfer_results()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker().transfer_results()
        return KVConnectorTransferResults(sending, recving, failed)

    def build_connector_worker_meta(self):
        return self.worker.worker_meta() if self.worker is not None else None

    def shutdown(self) -> None:
        # The staging files go with the engine, and the node unmaps them.
        if self.worker is not None:
            self.worker.close()
            if self.worker.shared is not None:
                self.worker.shared.unlink()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    # --- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # None: another node's prefix is still being fetched; vLLM asks again next step.
        return self._scheduler().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler().after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return self._scheduler().hit_sources_of(request, num_external_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler().kv_cache_manager = kv_cache_manager

    def on_new_request(self, request) -> None:
        self._scheduler().on_new_request(request)

    def build_connector_meta(self, scheduler_output) -> FabricMeta:
        return self._scheduler().build_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler().on_output(connector_output)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        return self._scheduler().finished(request, block_ids)

    def request_finished(self, request, block_ids: list[int]):
        return self._scheduler().finished(request, (block_ids,))

    # --- metrics (connector_metrics.py) -------------------------------------------------
    def get_kv_connector_stats(self) -> FabricStats | None:
        """The scheduler side's counters' increments since the last call (vLLM asks each
        step, on both sides: the workers count nothing of their own). On the scheduler's
        side vLLM asks after the step's requests finished: the node hears them now."""
        if self.scheduler is None:
            return None
        self.scheduler.send_report()
        changed = self.stats_reader.since_last(self.scheduler.stats)
        return FabricStats(data=changed) if changed else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> FabricStats:
        return FabricStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> FabricPromMetrics:
        return FabricPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _served_name(model_config) -> str:
    name = model_config.served_model_name
    if isinstance(name, (list, tuple)):
        name = name[0] if name else ""
    return str(name or model_config.model)
