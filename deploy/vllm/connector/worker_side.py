"""The FabricConnector's worker side (vLLM's worker process): block <-> staging copies.

vLLM gives one tensor per layer, which block_format.py views as [blocks, kv_heads, 2,
block_size, head_dim] whatever the backend; a fabric page of a pool is [layers, 2, page,
kv_heads, head_dim], in host memory shared with the node actor. A page holds every KV
head: under tensor parallelism each rank's worker copies its own heads (plan.HeadShard)
into and out of the same staging page, so ranks write disjoint bytes. On a GPU the blocks are
in device memory and each copy crosses to the host once per layer and job, on a stream of
its own.

Copies run off the engine's step, and are reported when done (get_finished, the worker
meta). One background thread plans each job in turn; on a CPU engine it hands the bytes to
the C copy queue (page_bytes.copy_queue), whose thread never takes the GIL, so a copy that
ends while the engine's thread runs Python is seen done at once; elsewhere the background
thread copies them itself. A load's request waits outside the batch until then and vLLM
keeps a finished request's blocks until its save is reported sent, so neither is touched
meanwhile. A prompt's save (its request still running) is the exception: vLLM may free
blocks of a preempted request or outside a sliding window and hand them to another request,
so a step that hands out a block such a save still reads waits for it before its forward
can write them (`handle_preemptions`, vLLM's hook before the forward for connectors with
asynchronous saves). No layer hook does any work.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import NamedTuple, cast

import numpy as np
import torch
from kvfabric.core.cache.layout import PoolName
from kvfabric.core.cache.native_copy import CopyQueue, CopyTicket
from kvfabric.core.cache.page_bytes import RowCopy, buffer_of, copy_queue, copy_rows
from kvfabric.transport.staging import StagingPages, StagingSpec

from .block_format import BlockFormat
from .copy_cores import leave_the_forward
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
        self.shared: StagingPages | None = None
        self.views: dict[str, torch.Tensor] = {}  # layer -> [blocks, H, 2, page, D]
        self.by_pool: dict[PoolName, list[LayerSlot]] = {p: [] for p in plan.layout.pools}
        for slot in plan.layers:
            self.by_pool[slot.pool].append(slot)
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.finished_sending: set[str] = set()
        self.saved: dict[str, int] = {}
        self.failed_saves: set[str] = set()
        # One copy thread: jobs run in the order the steps gave them; on a CPU engine, on
        # the cores vLLM leaves its forward's threads (copy_cores.py).
        self._copies = ThreadPoolExecutor(
            1, thread_name_prefix="kvf-copy", initializer=leave_the_forward
        )
        self._loads: list[Copying] = []
        self._saves: list[Copying] = []
        self._stream: torch.cuda.Stream | None = None  # for the copies, blocks on a GPU
        # On a CPU engine with the C row copy: each layer's buffers, made once (register),
        # so that a job is one submit to the copy queue.
        self._buffers: dict[str, LayerBuffers] = {}
        self._queue: CopyQueue | None = None

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
        self.shared = StagingPages(self.spec, lay)
        self._buffers = self._make_buffers()
        if self._buffers:
            self._queue = copy_queue()  # its thread starts in the copy thread, on its cores
        device = next(iter(self.views.values())).device if self.views else None
        if device is not None and device.type == "cuda":
            self._stream = torch.cuda.Stream(device)

    # --- loads -------------------------------------------------------------------------
    def before_forward(self, meta: FabricMeta) -> None:
        """Where the step hands out a block a prompt's save still reads (meta.fence: vLLM
        freed it since, at a preemption, a sliding window or an abort), the prompts' saves
        still copying end here, before the forward may write it; else they run on."""
        if not meta.fence:
            return
        _wait_all([c for c in self._saves if not c.job.ends_request], None)

    def start_load(self, meta: FabricMeta) -> None:
        """This step's loads start (vLLM calls this after the forward when every load of
        the step is asynchronous, as the fabric's are)."""
        self._loads.extend(Copying(job, self._submit(job, to_blocks=True)) for job in meta.loads)
        if meta.idle and (self._loads or self._saves):  # no forward to overlap: reported now
            _wait_all(self._loads + self._saves, None)

    # --- saves -------------------------------------------------------------------------
    def save(self, meta: FabricMeta) -> None:
        """After the forward: this step's saves start."""
        self._saves.extend(Copying(job, self._submit(job, to_blocks=False)) for job in meta.saves)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every copy started; False if some still run."""
        return _wait_all(self._loads + self._saves, timeout)

    def close(self) -> None:
        """Let the copies started end (they read or write the staging pages), then stop."""
        self._copies.shutdown(wait=True, cancel_futures=False)
        _wait_all(self._loads + self._saves, None)

    def _submit(self, job: CopyJob, to_blocks: bool) -> Future[CopyTicket | None]:
        after = None
        if self._stream is not None and not to_blocks:  # a save reads what the forward wrote
            after = torch.cuda.current_stream(self._stream.device).record_event()
        return self._copies.submit(self._run, job, to_blocks, after)

    def _run(self, job: CopyJob, to_blocks: bool, after) -> CopyTicket | None:
        """In the copy thread: the job's copies, done or handed to the copy queue (its
        ticket); a failure is the future's exception."""
        try:
            if job.doomed:
                raise RuntimeError(job.doomed)
            if self.step_hook is not None:
                self.step_hook(
                    ConnectorStep.WORKER_LOAD if to_blocks else ConnectorStep.WORKER_SAVE
                )
            stream = self._stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None and after is not None:
                    stream.wait_event(after)
                ticket = self._copy(job, to_blocks)
                if stream is not None:
                    stream.synchronize()  # done means the bytes are there
            return ticket
        except Exception as e:  # a load: vLLM recomputes; a save: nothing stored
            log.warning(
                "fabric %s failed for %s: %r", "load" if to_blocks else "save", job.req_id, e
            )
            raise

    def _collect(self) -> None:
        """Report the copies that have ended, in the order they started."""
        for load in _take_ended(self._loads):
            if load.handed.exception() is not None:
                self.failed_recving.add(load.job.req_id)
            self.finished_recving.add(load.job.req_id)
        for save in _take_ended(self._saves):
            if save.handed.exception() is None:
                self.saved[save.job.key] = 1
            else:
                self.failed_saves.add(save.job.key)
            if save.job.ends_request:  # the blocks are vLLM's again, whatever happened
                self.finished_sending.add(save.job.req_id)

    def _layer_pages(self, slot: LayerSlot) -> torch.Tensor:
        """[slots, 2, page, heads, D]: this rank's heads of every staged page of a layer."""
        assert self.shared is not None
        s = self.shard
        return self.shared.pools[slot.pool][:, slot.index, :, :, s.first : s.first + s.count]

    def _make_buffers(self) -> dict[str, LayerBuffers]:
        out = {}
        for slot in self.plan.layers:
            pages, view = self._layer_pages(slot), self.views[slot.name]
            made = [buffer_of(t) for t in (view, pages, _to_pages(view), _to_blocks(pages))]
            if any(b is None for b in made):
                return {}  # not the CPU, or no C kernel: copy_rows per layer
            out[slot.name] = LayerBuffers(*cast(list[np.ndarray], made))
        return out

    def _copy(self, job: CopyJob, to_blocks: bool) -> CopyTicket | None:
        """The job's copies: handed to the copy queue (their ticket), or done here."""
        assert self.shared is not None, "register_kv_caches comes first"
        s = self.shard
        if not to_blocks and not s.writes:
            return None  # another rank writes these heads (replicated over ranks)
        rows = self._layer_rows(job)
        if self._queue is not None:
            # One submit a job: no torch views between layers, and no GIL to end.
            copies: list[RowCopy] = []
            for slot, block_rows, slot_rows in rows:
                b = self._buffers[slot.name]
                if to_blocks:
                    copies.append((b.pages_as_blocks, slot_rows, b.blocks, block_rows))
                else:
                    copies.append((b.blocks_as_pages, block_rows, b.staged, slot_rows))
            return self._queue.submit(copies)
        # Elsewhere (a GPU, KVF_NATIVE=0): a copy per layer, the permute the reordering.
        for slot, block_rows, slot_rows in rows:
            view, pages = self.views[slot.name], self._layer_pages(slot)
            if to_blocks:
                copy_rows(pages, slot_rows.tolist(), view, block_rows.tolist(), _to_blocks)
            else:
                copy_rows(view, block_rows.tolist(), pages, slot_rows.tolist(), _to_pages)
        return None

    def _layer_rows(self, job: CopyJob) -> list[tuple[LayerSlot, np.ndarray, np.ndarray]]:
        """Per layer with pages to copy: its blocks and their staging slots (a block of
        -1 is one the layer's group does not hold: skipped)."""
        out = []
        for move in job.moves:
            slots = np.asarray(move.slots, dtype=np.int64)
            rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per block group
            for slot in self.by_pool[move.pool]:
                if slot.group not in rows:
                    blocks = np.asarray(move.blocks[slot.group], dtype=np.int64)
                    keep = blocks >= 0
                    rows[slot.group] = (blocks[keep], slots[: len(blocks)][keep])
                block_rows, slot_rows = rows[slot.group]
                if len(block_rows):
                    out.append((slot, block_rows, slot_rows))
        return out

    # --- reporting -----------------------------------------------------------------------
    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        self._collect()
        out = (self.finished_sending, self.finished_recving, self.failed_recving)
        self.finished_sending, self.finished_recving, self.failed_recving = set(), set(), set()
        return out

    def worker_meta(self) -> FabricWorkerMeta | None:
        self._collect()
        if not self.saved and not self.failed_saves:
            return None
        meta = FabricWorkerMeta(self.saved, self.failed_saves)
        self.saved, self.failed_saves = {}, set()
        return meta


class LayerBuffers(NamedTuple):
    """One layer's memory as the C row copy takes it (page_bytes.buffer_of)."""

    blocks: np.ndarray  # vLLM's blocks: a load's destination
    staged: np.ndarray  # this rank's heads of the staged pages: a save's destination
    blocks_as_pages: np.ndarray  # the blocks in the pages' order: a save's source
    pages_as_blocks: np.ndarray  # the staged pages in the blocks' order: a load's source


def _to_blocks(pages: torch.Tensor) -> torch.Tensor:
    return pages.permute(0, 3, 1, 2, 4)  # [n, 2, page, H, D] -> the blocks' [n, H, 2, page, D]


def _to_pages(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.permute(0, 2, 3, 1, 4)  # the blocks' [n, H, 2, page, D] -> [n, 2, page, H, D]


class Copying(NamedTuple):
    """A job started: the copy thread's part (its hook, its plan and, on a CPU engine, the
    hand-off to the copy queue: the ticket), then the queue's."""

    job: CopyJob
    handed: Future[CopyTicket | None]

    def ended(self) -> bool:
        if not self.handed.done():
            return False
        ticket = self._ticket()
        return ticket is None or ticket.done()

    def wait(self, deadline: float | None) -> bool:
        """Wait until it ends or `deadline` (time.monotonic()) passes; True if it ended."""
        if wait_futures([self.handed], _left(deadline)).not_done:
            return False
        ticket = self._ticket()
        return ticket is None or ticket.wait(_left(deadline))

    def _ticket(self) -> CopyTicket | None:
        """Once handed: the queue's ticket (None: copied by the copy thread, or failed)."""
        return None if self.handed.exception() is not None else self.handed.result()


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _wait_all(started: list[Copying], timeout: float | None) -> bool:
    """Wait up to `timeout` seconds (None: no limit) for every copy; False if some still run."""
    deadline = None if timeout is None else time.monotonic() + timeout
    return all([c.wait(deadline) for c in started])


def _take_ended(started: list[Copying]) -> list[Copying]:
    """The leading run of ended copies, taken out of `started` (reports keep their order)."""
    n = 0
    while n < len(started) and started[n].ended():
        n += 1
    ended = started[:n]
    del started[:n]
    return ended
