"""FaultyTransport: wraps any transport and injects seeded or scripted faults,
so that chaos tests (ours and users') reach every failure path of a fetch."""

from __future__ import annotations

import time
from typing import Callable

import torch
from kvfabric.transport.base import (
    BackendError,
    PeerDisconnected,
    ReadSpec,
    TransferHandle,
    TransferState,
    TransferTimeout,
    Transport,
    as_index_array,
)

from .transfer import Fault, FaultKind, FaultPlan


class FaultyTransport(Transport):
    def __init__(
        self, inner: Transport, plan: FaultPlan, kill_peer: Callable[[str], None] | None = None
    ) -> None:
        self.inner, self.plan, self.kill_peer = inner, plan, kill_peer
        self._pools: dict[str, torch.Tensor] = {}
        self._faults: dict[int, tuple[Fault, dict[str, list[int]]]] = {}
        # Hung or delayed reads given up at their deadline: (handle, when it ends).
        self._given_up: dict[int, tuple[TransferHandle, float]] = {}

    # --- plain delegation ---------------------------------------------------------------
    def register_pool(self, name: str, tensor: torch.Tensor) -> None:
        self.inner.register_pool(name, tensor)
        self._pools[name] = tensor

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def connect(self, peer_name: str, metadata: bytes) -> None:
        self.inner.connect(peer_name, metadata)

    def disconnect(self, peer_name: str) -> None:
        self.inner.disconnect(peer_name)
        for key, (handle, _) in list(self._given_up.items()):
            if handle.peer == peer_name:  # the peer is gone: so are its reads
                del self._given_up[key]

    def close(self) -> None:
        self._faults.clear()
        self._given_up.clear()
        self.inner.close()

    # --- reads with faults ----------------------------------------------------------------
    def read(self, peer: str, spec: ReadSpec) -> TransferHandle:
        local = {pool: as_index_array(pair[1], pool).tolist() for pool, pair in spec.items()}
        fault = self.plan.next(sum(len(v) for v in local.values()))
        if fault is None:
            return self.inner.read(peer, spec)
        if fault.kind == FaultKind.PEER_DEATH:
            if self.kill_peer is None:
                raise PeerDisconnected(f"injected: peer {peer!r} died")
            self.kill_peer(peer)
            handle = self.inner.read(peer, spec)
        elif fault.kind == FaultKind.HANG:
            handle = TransferHandle(
                peer=peer, pages=sum(map(len, local.values())), nbytes=0, descriptors=0
            )
        elif fault.kind == FaultKind.FAIL_AFTER:
            handle = self.inner.read(peer, _first_pages(spec, fault.after))
        else:
            handle = self.inner.read(peer, spec)
        self._faults[id(handle)] = (fault, local)
        return handle

    def poll(self, handle: TransferHandle, deadline: float | None = None) -> bool:
        fault, local = self._faults.get(id(handle), (None, {}))
        if fault is None or fault.kind == FaultKind.PEER_DEATH:
            return self.inner.poll(handle, deadline)
        now = time.monotonic()
        due = handle.started + fault.delay_s  # a delayed read's end
        if fault.kind == FaultKind.HANG or (fault.kind == FaultKind.DELAY and now < due):
            if deadline is not None and now >= deadline:
                end = now + fault.delay_s if fault.kind == FaultKind.HANG else due
                self._faults.pop(id(handle), None)
                self._given_up[id(handle)] = (handle, end)
                handle.state = TransferState.GIVEN_UP
                raise TransferTimeout(
                    f"injected {fault.kind.value}: not done by the deadline; given up"
                )
            return False
        if (
            handle.state is TransferState.PENDING
            and handle.requests
            and not self.inner.poll(handle, deadline)
        ):
            return False
        self._faults.pop(id(handle), None)
        if fault.kind == FaultKind.FAIL_AFTER:
            handle.state = TransferState.FAILED
            raise BackendError(f"injected: transfer failed after {fault.after} pages")
        if fault.kind == FaultKind.CORRUPT:
            for pool, pages in local.items():
                if pages:
                    self._pools[pool][pages[-1]].view(torch.uint8).view(-1)[0] ^= 0x5A
        handle.state = TransferState.DONE
        return True

    def drained(self, peer: str) -> bool:
        inner = self.inner.drained(peer)  # polls a delayed read's real requests too
        now = time.monotonic()
        for key, (handle, end) in list(self._given_up.items()):
            if handle.peer == peer and now >= end:
                del self._given_up[key]
        return inner and not any(h.peer == peer for h, _ in self._given_up.values())

    def abort(self, handle: TransferHandle) -> None:
        self._faults.pop(id(handle), None)
        self._given_up.pop(id(handle), None)
        if handle.state is TransferState.PENDING:
            handle.state = TransferState.ABORTED
        if handle.requests:
            self.inner.abort(handle)


def _first_pages(spec: ReadSpec, k: int) -> dict:
    out, left = {}, k
    for pool, (remote, local) in spec.items():
        r, l_ = as_index_array(remote, pool).tolist(), as_index_array(local, pool).tolist()
        out[pool] = (r[:left], l_[:left])
        left -= len(out[pool][0])
    return out
