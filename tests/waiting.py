"""Waiting on a condition in tests: poll at a pace under a deadline, never a bare sleep."""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def eventually(
    check: Callable[[], T],
    what: str = "condition",
    *,
    deadline_s: float = 60.0,
    every_s: float = 0.2,
) -> T:
    """Poll `check` until it returns something truthy; that value. Fails naming `what`
    once `deadline_s` has passed."""
    end = time.monotonic() + deadline_s
    while not (value := check()):
        assert time.monotonic() < end, f"not reached in {deadline_s} s: {what}"
        time.sleep(every_s)
    return value


def stop_process(pid: int, deadline_s: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every thread of it has stopped. The kernel stops them
    asynchronously: on a loaded machine one (a transport's progress thread) may still
    answer a peer for a while after kill() returns."""
    os.kill(pid, signal.SIGSTOP)
    eventually(
        lambda: _all_stopped(pid), f"process {pid} stopped", deadline_s=deadline_s, every_s=0.005
    )


def _all_stopped(pid: int) -> bool:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # a thread that ended since the listing
            continue
        if state not in ("T", "t", "Z", "X"):  # stopped (by a signal, a tracer) or gone
            return False
    return True
