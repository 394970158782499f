"""FaultyTransport: wraps any transport and injects seeded or scripted faults,
so that chaos tests (ours and users') reach every failure path of a fetch."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

import torch

from .base import (BackendError, PeerDisconnected, ReadSpec, Transport, TransferHandle,
                   TransferState, TransferTimeout, as_index_array)


class FaultKind(str, Enum):
    FAIL_AFTER = "fail_after"    # copy the first `after` pages, then fail
    DELAY = "delay"              # complete, but only after `delay_s`
    HANG = "hang"                # never complete: the caller's deadline must abort it
    CORRUPT = "corrupt"          # complete with one byte flipped in every pool read
    PEER_DEATH = "peer_death"    # the peer dies as the read starts


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    after: int = 0
    delay_s: float = 0.0


class FaultPlan:
    """Which fault hits each read: the scripted ones first, in order (None for
    a clean read), then each read with probability `rate`, from `seed`."""

    def __init__(self, script: Sequence[Fault | None] = (), seed: int = 0, rate: float = 0.0,
                 kinds: Sequence[FaultKind] = tuple(FaultKind), max_delay_s: float = 0.05) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self._script = list(script)
        self._rng = random.Random(seed)
        self.rate, self.kinds, self.max_delay_s = rate, tuple(FaultKind(k) for k in kinds), max_delay_s
        self.injected: list[Fault] = []

    def next(self, pages: int) -> Fault | None:
        if self._script:
            fault = self._script.pop(0)
        elif self.rate and self._rng.random() < self.rate:
            kind = self._rng.choice(self.kinds)
            fault = Fault(kind, after=self._rng.randrange(max(1, pages)),
                          delay_s=self._rng.uniform(0, self.max_delay_s))
        else:
            fault = None
        if fault is not None:
            self.injected.append(fault)
        return fault


class FaultyTransport(Transport):
    def __init__(self, inner: Transport, plan: FaultPlan,
                 kill_peer: Callable[[str], None] | None = None) -> None:
        self.inner, self.plan, self.kill_peer = inner, plan, kill_peer
        self._pools: dict[str, torch.Tensor] = {}
        self._faults: dict[int, tuple[Fault, dict[str, list[int]]]] = {}

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

    def close(self) -> None:
        self._faults.clear()
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
            handle = TransferHandle(peer=peer, pages=sum(map(len, local.values())), nbytes=0, descriptors=0)
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
        if fault.kind == FaultKind.HANG or (
                fault.kind == FaultKind.DELAY and time.monotonic() < handle.started + fault.delay_s):
            if deadline is not None and time.monotonic() >= deadline:
                self.abort(handle)
                raise TransferTimeout(f"injected {fault.kind.value}: not done by the deadline; aborted")
            return False
        if handle.state is TransferState.PENDING and handle.requests and not self.inner.poll(handle, deadline):
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

    def abort(self, handle: TransferHandle) -> None:
        self._faults.pop(id(handle), None)
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
