"""The FabricConnector's worker side (vLLM's worker process): block <-> staging copies.

vLLM gives one tensor per layer, which block_format.py views as [blocks, kv_heads, 2,
block_size, head_dim] whatever the backend; a fabric page of a pool is [layers, 2, page,
kv_heads, head_dim], in host memory shared with the node actor. A page holds every KV
head: under tensor parallelism each rank's worker copies its own heads (plan.HeadShard)
into and out of the same staging page, so ranks write disjoint bytes. On a GPU the blocks are
in device memory and each copy crosses to the host once per layer and job. All copies of a
step's jobs happen in start_load_kv (loads, for requests waiting outside the batch) and
wait_for_save (saves
of finished requests, whose blocks vLLM keeps until we report them sent), so no
layer hook does any work.
"""

from __future__ import annotations

import logging

import torch
from kvfabric.fabric import PoolName
from kvfabric.transport.staging import SharedPages, StagingSpec

from .block_format import BlockFormat
from .jobs import ConnectorStep, CopyJob, FabricMeta, FabricSettings, FabricWorkerMeta
from .plan import EnginePlan, HeadShard, LayerSlot

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(
        self, plan: EnginePlan, settings: FabricSettings, spec: StagingSpec, rank: int = 0
    ) -> None:
        self.plan = plan
        self.shard: HeadShard = plan.shard(rank)
        self.settings = settings
        self.step_hook = settings.make_step_hook()  # tests, chaos: fail a load or save here
        self.spec = spec
        self.shared: SharedPages | None = None
        self.views: dict[str, torch.Tensor] = {}  # layer -> [blocks, H, 2, page, D]
        self.by_pool: dict[PoolName, list[LayerSlot]] = {p: [] for p in plan.layout.pools}
        for slot in plan.layers:
            self.by_pool[slot.pool].append(slot)
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.finished_sending: set[str] = set()
        self.saved: dict[str, int] = {}
        self.failed_saves: set[str] = set()

    def register(self, kv_caches: dict[str, torch.Tensor], fmt: BlockFormat) -> None:
        lay = self.plan.layout
        for slot in self.plan.layers:
            try:
                self.views[slot.name] = fmt.view(
                    kv_caches[slot.name], self.shard.count, lay.page_size, lay.head_dim
                )
            except RuntimeError as e:
                raise RuntimeError(f"{slot.name} ({fmt.value}): {e}") from None
        if self.step_hook is not None:
            self.step_hook(ConnectorStep.STAGING)  # raising here fails the engine's start
        self.shared = SharedPages(self.spec, lay)

    # --- loads -------------------------------------------------------------------------
    def start_load(self, meta: FabricMeta) -> None:
        for job in meta.loads:
            try:
                if job.doomed:
                    raise RuntimeError(job.doomed)
                if self.step_hook is not None:
                    self.step_hook(ConnectorStep.WORKER_LOAD)
                self._copy(job, to_blocks=True)
            except Exception as e:  # reported as a failed receive: vLLM recomputes
                log.warning("fabric load failed for %s: %r", job.req_id, e)
                self.failed_recving.add(job.req_id)
            self.finished_recving.add(job.req_id)

    # --- saves -------------------------------------------------------------------------
    def save(self, meta: FabricMeta) -> None:
        for job in meta.saves:
            try:
                if self.step_hook is not None:
                    self.step_hook(ConnectorStep.WORKER_SAVE)
                self._copy(job, to_blocks=False)
                self.saved[job.key] = 1
            except Exception as e:  # nothing stored; the blocks are freed all the same
                log.warning("fabric save failed for %s: %r", job.key, e)
                self.failed_saves.add(job.key)
            if job.ends_request:
                self.finished_sending.add(job.req_id)

    def _copy(self, job: CopyJob, to_blocks: bool) -> None:
        assert self.shared is not None, "register_kv_caches comes first"
        s = self.shard
        if not to_blocks and not s.writes:
            return  # another rank writes these heads (replicated over ranks)
        for move in job.moves:
            staging = self.shared.pools[move.pool]
            for slot in self.by_pool[move.pool]:
                blocks = move.blocks[slot.group]
                keep = [i for i, b in enumerate(blocks) if b >= 0]
                if not keep:
                    continue
                view = self.views[slot.name]
                block_idx = torch.tensor(
                    [blocks[i] for i in keep], dtype=torch.long, device=view.device
                )
                slot_idx = torch.tensor([move.slots[i] for i in keep], dtype=torch.long)
                # [slots, 2, page, heads, D]: this rank's heads of every page, in place
                layer_pages = staging[:, slot.index, :, :, s.first : s.first + s.count]
                if to_blocks:
                    pages = layer_pages.index_select(0, slot_idx).permute(0, 3, 1, 2, 4)
                    view.index_copy_(0, block_idx, pages.to(view.device))
                else:
                    pages = view.index_select(0, block_idx).permute(0, 2, 3, 1, 4)
                    layer_pages.index_copy_(0, slot_idx, pages.to("cpu"))

    # --- reporting -----------------------------------------------------------------------
    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        out = (self.finished_sending, self.finished_recving, self.failed_recving)
        self.finished_sending, self.finished_recving, self.failed_recving = set(), set(), set()
        return out

    def worker_meta(self) -> FabricWorkerMeta | None:
        if not self.saved and not self.failed_saves:
            return None
        meta = FabricWorkerMeta(self.saved, self.failed_saves)
        self.saved, self.failed_saves = {}, set()
        return meta
