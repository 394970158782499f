"""Pacing a wait (transport/pacer.py, Transport.wait): a bounded spin, then doubling
naps up to a cap, never past the deadline. Driven by a fake clock: behaviour, not time."""

from __future__ import annotations

import pytest
from kvfabric.transport import base as transport_base
from kvfabric.transport.base import TransferHandle, TransferState, TransferTimeout, Transport
from kvfabric.transport.pacer import NAP_MAX_S, NAP_MIN_S, SPIN_S, PollPacer


class Clock:
    """time.monotonic and time.sleep of transport.base: sleeping advances the clock."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.naps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.naps.append(s)
        self.now += s


class CountedTransport(Transport):
    """Completes a read at its `done_after`-th poll; each poll costs `poll_s` of the
    clock. Honours the deadline as the contract says (given up, TransferTimeout)."""

    def __init__(self, clock: Clock, done_after: int, poll_s: float = 5e-6) -> None:
        self.clock, self.done_after, self.poll_s = clock, done_after, poll_s
        self.polls = 0

    def poll(self, handle: TransferHandle, deadline: float | None = None) -> bool:
        self.polls += 1
        self.clock.now += self.poll_s
        if self.polls >= self.done_after:
            handle.state = TransferState.DONE
            return True
        if deadline is not None and self.clock.now >= deadline:
            handle.state = TransferState.GIVEN_UP
            raise TransferTimeout("fake: deadline passed")
        return False

    def register_pool(self, name, tensor) -> None: ...
    def metadata(self) -> bytes:
        return b""

    def connect(self, peer_name, metadata) -> None: ...
    def disconnect(self, peer_name) -> None: ...
    def read(self, peer, spec) -> TransferHandle:
        return TransferHandle(peer=peer, pages=1, nbytes=1, descriptors=1)

    def drained(self, peer) -> bool:
        return True

    def abort(self, handle) -> None: ...
    def close(self) -> None: ...


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(transport_base.time, "monotonic", c.monotonic)
    monkeypatch.setattr(transport_base.time, "sleep", c.sleep)
    return c


def test_pacer_spins_within_its_budget_then_doubles_its_naps_up_to_the_cap() -> None:
    pacer = PollPacer()
    assert pacer.pause(0.0, 1.0) == 0.0 and pacer.pause(SPIN_S * 0.99, 1.0) == 0.0
    naps = [pacer.pause(SPIN_S + i * 1e-3, 1.0) for i in range(8)]
    assert naps[0] == NAP_MIN_S
    assert all(b == min(NAP_MAX_S, 2 * a) for a, b in zip(naps, naps[1:]))
    assert naps[-1] == NAP_MAX_S
    assert pacer.pause(1.0, 3e-6) == 3e-6  # never past the deadline
    assert pacer.pause(1.0, -1.0) == 0.0


def test_a_read_done_within_the_spin_budget_is_waited_for_without_sleeping(clock) -> None:
    t = CountedTransport(clock, done_after=20)  # 100 µs of polls
    h = t.read("p", {})
    t.wait(h, 1.0)
    assert h.done and t.polls == 20 and clock.naps == []


def test_a_slow_read_is_waited_for_with_doubling_naps(clock) -> None:
    t = CountedTransport(clock, done_after=200)
    h = t.read("p", {})
    t.wait(h, 1.0)
    assert h.done and t.polls == 200
    assert clock.naps[0] == NAP_MIN_S and max(clock.naps) == NAP_MAX_S
    assert clock.naps == sorted(clock.naps)
    spun = SPIN_S / t.poll_s  # polls made before the first nap
    assert t.polls - len(clock.naps) >= spun - 1


def test_a_read_past_its_deadline_raises_after_sleeping_no_later_than_it(clock) -> None:
    t = CountedTransport(clock, done_after=10**9)
    h = t.read("p", {})
    start = clock.now
    with pytest.raises(TransferTimeout):
        t.wait(h, 0.01)
    assert h.state is TransferState.GIVEN_UP
    assert clock.now - start <= 0.01 + t.poll_s  # the last nap ended at the deadline
