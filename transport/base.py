"""Transport interface: batched page READs from a peer's registered pools.

A transport owns a set of named *pools*: contiguous torch tensors whose first dimension
indexes pages ([capacity, ...]). A peer is connected from the bytes its `metadata()`
returns; a `read` copies pages of the peer's pools into ours and returns a handle that is
polled against a deadline. Failures surface as `TransferError` subclasses only, whatever
the backend raised, so callers can roll back on one exception type.
"""

from __future__ import annotations

import abc
import base64
import enum
import json
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

import numpy as np
import torch

from .native_plan import PLAN
from .pacer import PollPacer
from .runs import order_pairs, run_starts

# Page indices as callers hold them: a list, a numpy array or a torch tensor of ints.
Indices = Union[Sequence[int], np.ndarray, torch.Tensor]
# {pool name: (remote page indices, local page indices)}; pair i copies remote[i] -> local[i].
ReadSpec = Mapping[str, tuple[Indices, Indices]]

_METADATA_VERSION = 1
# A duplicate check scatters into a mask of the pool's capacity while clearing it costs
# less than sorting the indices would (a sort of 1k indices ~ clearing 64k bytes).
_MASK_PER_INDEX = 64


class TransferError(Exception):
    """Base of every transfer failure; the destination pages are undefined afterwards.

    They may even be written *later*: with UCX over tcp, bytes of a READ aborted while
    the peer was stopped landed once it resumed, after the abort and after a
    disconnect. So a transport never cancels a read it gives up on: it keeps its
    requests and `Transport.drained` says once all of a peer's have completed; until
    then, or until the peer is known dead (its process gone), keep their pages out of
    circulation. A later read completing proves nothing about an earlier one (UCX
    orders one lane, and a transfer may take several)."""


class TransferTimeout(TransferError):
    """The deadline passed before the transfer completed; it is given up, not cancelled
    (its requests stay held: `Transport.drained` says when they end)."""


class PeerDisconnected(TransferError):
    """The peer went away (killed, network lost) before or during the transfer."""


class PeerNotConnected(TransferError):
    """No peer of that name is connected (never connected, or disconnected since)."""


class TransferAborted(TransferError):
    """The handle was aborted (explicitly, or by an earlier timeout or error)."""


class BackendError(TransferError):
    """The backend failed for another reason (its exception is chained as __cause__)."""


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"  # a request failed; held (the others may still run) until disconnect
    GIVEN_UP = "given_up"  # the deadline passed; held until `drained` sees it complete
    ABORTED = "aborted"


class MemKind(enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True)
class PoolLayout:
    """Where a pool's pages live; peers build their descriptors from this."""

    base: int  # address of page 0
    page_bytes: int
    capacity: int  # number of pages
    mem: MemKind
    device: int  # CUDA ordinal for VRAM, 0 for DRAM

    @staticmethod
    def of(tensor: torch.Tensor) -> "PoolLayout":
        """Layout of a pool tensor; it must be contiguous with at least one page."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"a pool must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() < 1 or tensor.shape[0] < 1 or tensor.numel() == 0:
            raise ValueError(f"a pool needs shape [capacity>=1, ...], got {tuple(tensor.shape)}")
        if not tensor.is_contiguous():
            raise ValueError("a pool tensor must be contiguous (pages are address ranges)")
        cuda = tensor.device.type == "cuda"
        if not cuda and tensor.device.type != "cpu":
            raise ValueError(f"pools must live on cpu or cuda, not {tensor.device}")
        capacity = tensor.shape[0]
        return PoolLayout(
            base=tensor.data_ptr(),
            page_bytes=tensor.numel() * tensor.element_size() // capacity,
            capacity=capacity,
            mem=MemKind.VRAM if cuda else MemKind.DRAM,
            device=tensor.device.index or 0,
        )

    def page_addresses(self) -> np.ndarray:
        return self.base + np.arange(self.capacity, dtype=np.uint64) * np.uint64(self.page_bytes)


@dataclass(frozen=True)
class PeerMetadata:
    """What `Transport.metadata()` serializes: the agent's name, the backend's own
    connection blob and the layout of every pool."""

    name: str
    backend_blob: bytes
    pools: dict[str, PoolLayout]

    def to_bytes(self) -> bytes:
        pools = {k: {**v.__dict__, "mem": v.mem.value} for k, v in self.pools.items()}
        doc = {
            "v": _METADATA_VERSION,
            "name": self.name,
            "pools": pools,
            "blob": base64.b64encode(self.backend_blob).decode("ascii"),
        }
        return json.dumps(doc, sort_keys=True).encode()

    @staticmethod
    def from_bytes(data: bytes) -> "PeerMetadata":
        try:
            doc = json.loads(data)
            if doc.get("v") != _METADATA_VERSION:
                raise ValueError(f"metadata version {doc.get('v')!r} != {_METADATA_VERSION}")
            pools = {
                k: PoolLayout(**{**v, "mem": MemKind(v["mem"])}) for k, v in doc["pools"].items()
            }
            return PeerMetadata(doc["name"], base64.b64decode(doc["blob"]), pools)
        except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed transport metadata: {e}") from e


@dataclass
class TransferHandle:
    """One batched read: a backend request per pool, polled together."""

    peer: str
    pages: int
    nbytes: int
    descriptors: int  # after coalescing contiguous runs
    requests: list[Any] = field(default_factory=list)  # backend-private
    state: TransferState = TransferState.PENDING
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    backend_descriptors: int | None = None  # as the backend reports it, when it can

    @property
    def done(self) -> bool:
        return self.state is TransferState.DONE


@dataclass(frozen=True)
class PoolRead:
    """A validated read of one pool, pages already ordered for coalescing."""

    pool: str
    remote: np.ndarray  # int32, what NIXL's prepared-descriptor indices take
    local: np.ndarray
    descriptors: int  # runs contiguous on both sides, one descriptor each once merged


def coalesce_order(remote: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Pairs ordered so that runs contiguous on *both* sides are adjacent, and the number
    of those runs (= descriptors once merged). Indices must be >= 0."""
    r, l_ = order_pairs(remote, local)
    return r, l_, len(run_starts(r, l_))


def as_index_array(idx: Indices, what: str) -> np.ndarray:
    """Integer page indices as a 1-d int64 array; rejects floats, bools and nesting."""
    if isinstance(idx, torch.Tensor):
        idx = idx.detach().cpu().numpy()
    arr = np.asarray(idx)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{what}: page indices must be a 1-d sequence of ints, "
            f"got dtype {arr.dtype} shape {arr.shape}"
        )
    return arr.astype(np.int64, copy=False)


def check_range(idx: np.ndarray, capacity: int, what: str) -> None:
    if len(idx) and (idx.min() < 0 or idx.max() >= capacity):
        bad = idx[(idx < 0) | (idx >= capacity)][0]
        raise ValueError(f"{what}: page index {int(bad)} out of range [0, {capacity})")


def has_duplicates(idx: np.ndarray, capacity: int) -> bool:
    """Whether an index in [0, capacity) appears twice: a scatter into a mask while
    that stays small, a sort beyond (np.unique costs ~10x the scatter at 1k pages)."""
    if capacity <= _MASK_PER_INDEX * max(len(idx), 64):
        seen = np.zeros(capacity, dtype=np.bool_)
        seen[idx] = True
        return int(np.count_nonzero(seen)) != len(idx)
    s = np.sort(idx)
    return bool((s[1:] == s[:-1]).any())


def plan_pool_read(
    pool: str,
    spec: tuple[Indices, Indices],
    local: PoolLayout,
    remote: PoolLayout,
    native: bool | None = None,
) -> PoolRead:
    """Validate one pool's index lists against both layouts; order them for coalescing.
    In C where it is built (`native`: None as KVF_NATIVE says, True: C, False: numpy)."""
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        raise ValueError(f"pool {pool!r}: expected (remote_indices, local_indices)")
    r = as_index_array(spec[0], f"pool {pool!r} remote")
    l_ = as_index_array(spec[1], f"pool {pool!r} local")
    if len(r) != len(l_):
        raise ValueError(f"pool {pool!r}: {len(r)} remote indices but {len(l_)} local")
    if native is None:
        native = PLAN is not None
    if native:
        if PLAN is None:
            raise RuntimeError("the native read plan asked for, but its extension is not loaded")
        out_r, out_l = np.empty(len(r), dtype=np.int32), np.empty(len(r), dtype=np.int32)
        runs = PLAN.order(
            np.ascontiguousarray(r),
            np.ascontiguousarray(l_),
            remote.capacity,
            local.capacity,
            out_r,
            out_l,
        )
        if runs >= 0:
            return PoolRead(pool, out_r, out_l, runs)
        # An index out of range or a local page twice: the reference below says which.
    check_range(r, remote.capacity, f"pool {pool!r} remote")
    check_range(l_, local.capacity, f"pool {pool!r} local")
    if has_duplicates(l_, local.capacity):
        raise ValueError(f"pool {pool!r}: a local page appears twice (two writes to one page)")
    if native:
        raise AssertionError(f"pool {pool!r}: the native plan rejected a read the reference takes")
    r, l_ = order_pairs(r, l_)
    return PoolRead(pool, r.astype(np.int32), l_.astype(np.int32), len(run_starts(r, l_)))


class Transport(abc.ABC):
    """A node's page-transfer endpoint. Not thread-safe: one owner drives it."""

    @abc.abstractmethod
    def register_pool(self, name: str, tensor: torch.Tensor) -> None:
        """Register a pool once; peers see it in metadata taken afterwards."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """Self-description a peer passes to `connect`."""

    @abc.abstractmethod
    def connect(self, peer_name: str, metadata: bytes) -> None:
        """Connect (or reconnect, replacing the old state) to a peer."""

    @abc.abstractmethod
    def disconnect(self, peer_name: str) -> None:
        """Forget a peer; idempotent."""

    @abc.abstractmethod
    def read(self, peer: str, spec: ReadSpec) -> TransferHandle:
        """Post one batched READ per pool; raises ValueError before posting on bad input."""

    @abc.abstractmethod
    def poll(self, handle: TransferHandle, deadline: float | None = None) -> bool:
        """True once done. `deadline` is a time.monotonic() instant: past it the transfer
        is given up (held, see `drained`) and TransferTimeout raised."""

    @abc.abstractmethod
    def drained(self, peer: str) -> bool:
        """Whether every read from `peer` that no one waits for any more (given up at its
        deadline, or left when its waiter failed) has completed, so writes no more pages;
        polls them and frees those that have. One whose request failed never drains:
        a failed request does not say its transfer's other requests stopped; only
        `disconnect`, once the peer's process is gone, ends it. The owner calls this
        while it waits on no read from `peer`."""

    @abc.abstractmethod
    def abort(self, handle: TransferHandle) -> None:
        """Stop waiting for the transfer and free its resources; never raises, idempotent.
        The backend may still write the destination pages afterwards (see TransferError):
        for a peer that is gone (`disconnect`) or a transport closing."""

    @abc.abstractmethod
    def close(self) -> None:
        """Abort everything in flight, forget peers, unregister pools; idempotent."""

    def wait(self, handle: TransferHandle, deadline_s: float) -> None:
        """Block until `handle` completes, at most `deadline_s` seconds from now. Paced
        by `PollPacer`: a bounded spin, then doubling naps (a waiter that spins on
        starves the progress threads of a small host)."""
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s!r}")
        start = time.monotonic()
        deadline = start + deadline_s
        pacer = PollPacer()
        while not self.poll(handle, deadline):
            now = time.monotonic()
            nap = pacer.pause(now - start, deadline - now)
            if nap > 0:
                time.sleep(nap)

    def release(self) -> None:
        """Alias of close()."""
        self.close()

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
