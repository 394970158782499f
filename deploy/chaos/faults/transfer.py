"""Transfer faults: what a FaultyTransport does to a read, and the plan of which read
suffers which (scripted, then seeded)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum
from typing import Sequence


class FaultKind(str, Enum):
    FAIL_AFTER = "fail_after"  # copy the first `after` pages, then fail
    DELAY = "delay"  # complete, but only after `delay_s`
    # Not complete by the caller's deadline, then given up; it ends `delay_s` later (a
    # stopped peer that resumed): until then `drained` says its pages may still change.
    HANG = "hang"
    CORRUPT = "corrupt"  # complete with one byte flipped in every pool read
    PEER_DEATH = "peer_death"  # the peer dies as the read starts


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    after: int = 0
    delay_s: float = 0.0


class FaultPlan:
    """Which fault hits each read: the scripted ones first, in order (None for
    a clean read), then each read with probability `rate`, from `seed`."""

    def __init__(
        self,
        script: Sequence[Fault | None] = (),
        seed: int = 0,
        rate: float = 0.0,
        kinds: Sequence[FaultKind] = tuple(FaultKind),
        max_delay_s: float = 0.05,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate}")
        self._script = list(script)
        self._rng = random.Random(seed)
        self.rate, self.kinds, self.max_delay_s = (
            rate,
            tuple(FaultKind(k) for k in kinds),
            max_delay_s,
        )
        self.injected: list[Fault] = []

    def next(self, pages: int) -> Fault | None:
        if self._script:
            fault = self._script.pop(0)
        elif self.rate and self._rng.random() < self.rate:
            kind = self._rng.choice(self.kinds)
            fault = Fault(
                kind,
                after=self._rng.randrange(max(1, pages)),
                delay_s=self._rng.uniform(0, self.max_delay_s),
            )
        else:
            fault = None
        if fault is not None:
            self.injected.append(fault)
        return fault
