"""NIXL page transport (UCX backend): batched READs of page lists from a peer's pools.

Per pool, the local descriptor list (one descriptor per page) is prepared once at
registration and the remote one once per peer at connect; a read is then one
`makeXferReq` per pool over page *indices*, which costs tens of µs instead of a full
descriptor validation. Pairs are ordered so that pages contiguous on both sides are
adjacent, which NIXL (>= 1.5) merges into one descriptor (each costs ~8 µs to post).

NIXL has no timeout: a transfer towards a hung peer stays "in progress" forever, so
`poll` enforces the caller's deadline by giving the transfer up, not by releasing it
(releasing a live request cancels it, and cancelled bytes were seen to land later): its
requests stay held, and `drained` polls them until they complete. A peer killed
mid-transfer leaves the destination pages partly written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from .base import (
    BackendError,
    MemKind,
    PeerDisconnected,
    PeerMetadata,
    PeerNotConnected,
    PoolLayout,
    PoolRead,
    ReadSpec,
    TransferAborted,
    TransferError,
    TransferHandle,
    TransferState,
    TransferTimeout,
    Transport,
    plan_pool_read,
)

try:  # the `nixl` meta package picks the wheel matching the local CUDA ...
    from nixl import _bindings as _nb
except ImportError:  # ... but only nixl-cu12 may be installed (it runs on CPU hosts too).
    from nixl_cu12 import _bindings as _nb  # type: ignore[attr-defined]  # compiled: mypy sees no such name

# NIXL's exceptions share no base class besides Exception; catch exactly these.
_NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    v
    for k, v in vars(_nb).items()
    if k.startswith("nixl") and k.endswith("Error") and isinstance(v, type)
)


def quietly(fn: Any, *args: Any) -> bool:
    """Call a NIXL cleanup `fn(*args)`; whether it succeeded. A cleanup call must not mask
    the error being handled, so NIXL's errors are swallowed."""
    try:
        fn(*args)
        return True
    except _NIXL_ERRORS:
        return False


_ERROR_CLASSES: dict[str, type[TransferError]] = {
    "nixlRemoteDisconnectError": PeerDisconnected,
    "nixlNotFoundError": PeerNotConnected,
    "nixlCancelledError": TransferAborted,
}
_MEM = {MemKind.DRAM: _nb.DRAM_SEG, MemKind.VRAM: _nb.VRAM_SEG}


def map_nixl_error(exc: BaseException, what: str) -> TransferError:
    """Our exception for one raised by NIXL's bindings (chain it with `from exc`)."""
    name = type(exc).__name__
    return _ERROR_CLASSES.get(name, BackendError)(f"{what}: {name}: {exc}")


@dataclass
class _Pool:
    tensor: torch.Tensor  # held so the registered memory outlives the registration
    layout: PoolLayout
    reg: Any  # nixlRegDList, needed again to deregister
    dlist: int  # prepared local descriptor list (one per page)


@dataclass
class _Peer:
    metadata: bytes  # as connected: another process under the name brings others
    pools: dict[str, PoolLayout]
    dlists: dict[str, int] = field(default_factory=dict)  # prepared remote lists


@dataclass
class _Req:
    pool: str
    xfer: int
    done: bool = False
    released: bool = False


def _xfer_dlist(layout: PoolLayout) -> Any:
    descs = np.zeros((layout.capacity, 3), dtype=np.uint64)
    descs[:, 0] = layout.page_addresses()
    descs[:, 1] = layout.page_bytes
    descs[:, 2] = layout.device
    return _nb.nixlXferDList(_MEM[layout.mem], descs)


class NixlTransport(Transport):
    """One NIXL agent. `progress_delay_us` > 0 lets the progress thread sleep on UCX's
    event fds; the Python wrapper hard-codes 0, which spins a core per agent, and the
    thread is needed: without it a peer serves nothing while its owner is busy."""

    def __init__(
        self,
        name: str,
        *,
        backend: str = "UCX",
        progress_thread: bool = True,
        progress_delay_us: int = 100,
        telemetry: bool = False,
        backend_params: Mapping[str, str] | None = None,
    ) -> None:
        if not name:
            raise ValueError("a transport needs a non-empty, cluster-unique name")
        cfg = _nb.nixlAgentConfig()
        cfg.useProgThread = progress_thread
        cfg.useListenThread = False  # metadata travels through our own channel
        cfg.syncMode = _nb.NIXL_THREAD_SYNC_NONE  # single owner, as the wrapper does
        cfg.pthrDelay = progress_delay_us
        cfg.captureTelemetry = telemetry
        self.name = name
        self._telemetry = telemetry
        self._pools: dict[str, _Pool] = {}
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[int, TransferHandle] = {}
        self._leaked: list[int] = []  # requests NIXL refused to release yet
        self._closed = False
        try:
            self._agent = _nb.nixlAgent(name, cfg)
            plugins = self._agent.getAvailPlugins()
            if backend not in plugins:
                raise ValueError(f"NIXL backend {backend!r} unavailable; have {plugins}")
            self._backends = [self._agent.createBackend(backend, dict(backend_params or {}))]
        except _NIXL_ERRORS as e:
            raise map_nixl_error(e, f"creating agent {name!r}") from e

    # -- pools and peers --------------------------------------------------------

    def register_pool(self, name: str, tensor: torch.Tensor) -> None:
        self._require_open()
        if name in self._pools:
            raise ValueError(f"pool {name!r} is already registered")
        layout = PoolLayout.of(tensor)
        reg = _nb.nixlRegDList(
            _MEM[layout.mem],
            [(layout.base, layout.page_bytes * layout.capacity, layout.device, "")],
        )
        try:
            self._agent.registerMem(reg, self._backends)
        except _NIXL_ERRORS as e:
            raise map_nixl_error(e, f"registering pool {name!r}") from e
        try:
            dlist = self._agent.prepXferDlist(
                _nb.NIXL_INIT_AGENT, _xfer_dlist(layout), self._backends
            )
        except _NIXL_ERRORS as e:
            self._agent.deregisterMem(reg, self._backends)
            raise map_nixl_error(e, f"preparing pool {name!r}") from e
        self._pools[name] = _Pool(tensor, layout, reg, dlist)

    def metadata(self) -> bytes:
        self._require_open()
        layouts = {k: p.layout for k, p in self._pools.items()}
        return PeerMetadata(self.name, self._agent.getLocalMD(), layouts).to_bytes()

    def connect(self, peer_name: str, metadata: bytes) -> None:
        self._require_open()
        meta = PeerMetadata.from_bytes(metadata)
        if meta.name != peer_name or peer_name == self.name:
            raise ValueError(
                f"metadata of {meta.name!r} cannot connect peer {peer_name!r} from {self.name!r}"
            )
        for pool in meta.pools.keys() & self._pools.keys():
            ours, theirs = self._pools[pool].layout.page_bytes, meta.pools[pool].page_bytes
            if ours != theirs:
                raise ValueError(f"pool {pool!r}: peer pages are {theirs} B, ours {ours} B")
        known = self._peers.get(peer_name)
        if known is not None and known.metadata == metadata:
            return  # the same process again: its held reads stay tracked (see drained)
        self.disconnect(peer_name)  # a restarted peer comes back under its old name
        peer = _Peer(metadata, meta.pools)
        try:
            self._agent.loadRemoteMD(meta.backend_blob)
            self._peers[peer_name] = peer
            for pool in meta.pools.keys() & self._pools.keys():
                peer.dlists[pool] = self._agent.prepXferDlist(
                    peer_name, _xfer_dlist(meta.pools[pool]), self._backends
                )
            # Wire up now so that the first read does not pay for it under a deadline.
            self._agent.makeConnection(peer_name, self._backends)
        except _NIXL_ERRORS as e:
            self.disconnect(peer_name)
            raise map_nixl_error(e, f"connecting to {peer_name!r}") from e

    def disconnect(self, peer_name: str) -> None:
        peer = self._peers.pop(peer_name, None)
        if peer is None:
            return
        for h in [h for h in self._inflight.values() if h.peer == peer_name]:
            self.abort(h)  # their requests use the dlists released below
        for dlist in peer.dlists.values():
            quietly(self._agent.releasedDlistH, dlist)
        quietly(self._agent.invalidateRemoteMD, peer_name)

    def peers(self) -> list[str]:
        return list(self._peers)

    # -- transfers ----------------------------------------------------------------

    def read(self, peer: str, spec: ReadSpec) -> TransferHandle:
        self._require_open()
        plans = self._plan(peer, spec)
        handle = TransferHandle(
            peer=peer,
            pages=sum(len(p.local) for p in plans),
            nbytes=sum(len(p.local) * self._pools[p.pool].layout.page_bytes for p in plans),
            descriptors=sum(p.descriptors for p in plans),
        )
        if not plans:
            handle.state, handle.finished = TransferState.DONE, time.monotonic()
            return handle
        self._inflight[id(handle)] = handle
        try:
            for plan in plans:
                self._post(handle, plan)
        except TransferError:
            self._fail(handle)
            raise
        return handle

    def _plan(self, peer: str, spec: ReadSpec) -> list[PoolRead]:
        """Validate everything before anything is posted."""
        remote = self._peers.get(peer)
        if remote is None:
            raise PeerNotConnected(f"{self.name!r} is not connected to {peer!r}")
        if not hasattr(spec, "items"):
            raise ValueError("a read spec maps pool name -> (remote_indices, local_indices)")
        plans = []
        for pool, pair in spec.items():
            if pool not in self._pools:
                raise ValueError(f"unknown local pool {pool!r}; have {sorted(self._pools)}")
            if pool not in remote.dlists:
                raise ValueError(f"peer {peer!r} has no pool {pool!r}")
            plan = plan_pool_read(pool, pair, self._pools[pool].layout, remote.pools[pool])
            if len(plan.local):
                plans.append(plan)
        return plans

    def _post(self, handle: TransferHandle, plan: PoolRead) -> None:
        where = f"reading pool {plan.pool!r} from {handle.peer!r}"
        try:
            xfer = self._agent.makeXferReq(
                _nb.NIXL_READ,
                self._pools[plan.pool].dlist,
                plan.local,
                self._peers[handle.peer].dlists[plan.pool],
                plan.remote,
                "",
                self._backends,
            )
            req = _Req(plan.pool, xfer)
            handle.requests.append(req)
            status = self._agent.postXferReq(xfer, "")
        except _NIXL_ERRORS as e:
            error = map_nixl_error(e, where)
            if isinstance(error, PeerNotConnected):
                # We hold the peer as connected: NIXL dropped it as its connection died
                # (NIXL 1.3 says so with NOT_FOUND; 1.5 with a disconnect error).
                error = PeerDisconnected(str(error))
            raise error from e
        if status == _nb.NIXL_SUCCESS:
            req.done = True
        elif status != _nb.NIXL_IN_PROG:
            raise BackendError(f"{where}: post returned {status}")

    def poll(self, handle: TransferHandle, deadline: float | None = None) -> bool:
        if handle.state is TransferState.DONE:
            return True
        if handle.state is not TransferState.PENDING:
            raise TransferAborted(f"transfer from {handle.peer!r} is {handle.state.value}")
        try:
            for req in handle.requests:
                req.done = req.done or self._check(req, handle.peer)
        except TransferError:
            self._fail(handle)
            raise
        if all(r.done for r in handle.requests):
            self._complete(handle)
            return True
        if deadline is not None and time.monotonic() >= deadline:
            handle.state, handle.finished = TransferState.GIVEN_UP, time.monotonic()
            raise TransferTimeout(
                f"{handle.pages} pages from {handle.peer!r} not done after "
                f"{time.monotonic() - handle.started:.3f} s; given up (still held)"
            )
        return False

    def drained(self, peer: str) -> bool:
        ended = True
        for handle in [h for h in self._inflight.values() if h.peer == peer]:
            if handle.state is TransferState.FAILED:
                ended = False
                continue
            try:
                for req in handle.requests:
                    req.done = req.done or self._check(req, peer)
            except TransferError:
                self._fail(handle)
                ended = False
                continue
            if all(r.done for r in handle.requests):
                self._release(handle)  # complete: nothing more lands
            else:
                ended = False
        return ended

    def _fail(self, handle: TransferHandle) -> None:
        """A request failed (or could not be posted): the others may still run, so the
        handle stays held, never drained, until its peer is disconnected. With nothing
        posted, there is nothing to hold."""
        if handle.state is TransferState.PENDING or handle.state is TransferState.GIVEN_UP:
            handle.state, handle.finished = TransferState.FAILED, time.monotonic()
        if not handle.requests:
            self._release(handle)

    def _check(self, req: _Req, peer: str) -> bool:
        try:
            status = self._agent.getXferStatus(req.xfer)
        except _NIXL_ERRORS as e:
            raise map_nixl_error(e, f"reading pool {req.pool!r} from {peer!r}") from e
        if status == _nb.NIXL_SUCCESS:
            return True
        if status == _nb.NIXL_IN_PROG:
            return False
        raise BackendError(f"reading pool {req.pool!r} from {peer!r}: status {status}")

    def _complete(self, handle: TransferHandle) -> None:
        if self._telemetry:
            handle.backend_descriptors = sum(
                self._agent.getXferTelemetry(r.xfer).descCount for r in handle.requests
            )
        self._release(handle)
        handle.state, handle.finished = TransferState.DONE, time.monotonic()

    def abort(self, handle: TransferHandle, state: TransferState = TransferState.ABORTED) -> None:
        if handle.state is TransferState.PENDING:
            handle.state, handle.finished = state, time.monotonic()
        self._release(handle)

    def _release(self, handle: TransferHandle) -> None:
        """Free the requests; releasing one still in progress cancels it in NIXL."""
        self._inflight.pop(id(handle), None)
        for req in handle.requests:
            if not req.released:
                req.released = True
                if not quietly(self._agent.releaseXferReq, req.xfer):
                    self._leaked.append(req.xfer)

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        for handle in list(self._inflight.values()):
            self.abort(handle)
        for peer in list(self._peers):
            self.disconnect(peer)
        self._leaked = [x for x in self._leaked if not quietly(self._agent.releaseXferReq, x)]
        for pool in self._pools.values():
            quietly(self._agent.releasedDlistH, pool.dlist)
            quietly(self._agent.deregisterMem, pool.reg, self._backends)
        self._pools.clear()
        self._closed = True
        del self._agent  # the agent's destructor tears down UCX

    def _require_open(self) -> None:
        if self._closed:
            raise TransferError(f"transport {self.name!r} is closed")
