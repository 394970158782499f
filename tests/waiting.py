"""Waiting on a condition in tests: poll at a pace under a deadline, never a bare sleep."""

from __future__ import annotations

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
