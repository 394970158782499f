"""How long a waiter pauses between polls of a transfer.

Spin-polling sees a completion at once, and over UCX's tcp (or any transport that is
not done when posted) the waiter's own polls drive the transfer: sleeping through it,
even for its expected duration, stalls it. But a spinning waiter burns a core that on a
small host the peer's and our own NIXL progress threads need. So a waiter spins for a
bounded budget, then backs off with doubling naps up to a cap. It does not yield
(sched_yield) while spinning: on a loaded host that queues it behind every other
runnable process on its core, a scheduler tick (4 ms) for a 200 µs read. Reads that
complete as they are posted (UCX over CMA copies synchronously) never reach the pacer.
"""

from __future__ import annotations

from dataclasses import dataclass

SPIN_S = 250e-6  # poll back to back this long: most reads end within it
NAP_MIN_S = 20e-6  # first back-off nap (Linux sleeps last ~60 µs whatever is asked)
NAP_MAX_S = 200e-6  # a late transfer is still seen within this


@dataclass
class PollPacer:
    """Pauses for one wait; `pause` is called after each poll that found it pending."""

    spin_s: float = SPIN_S
    nap_s: float = 0.0  # the last back-off nap, 0 before backing off

    def pause(self, waited_s: float, left_s: float) -> float:
        """Seconds to sleep (0: poll again at once) `waited_s` into the wait, with
        `left_s` to its deadline; never past the deadline."""
        if waited_s < self.spin_s:
            return 0.0
        self.nap_s = min(NAP_MAX_S, max(NAP_MIN_S, 2 * self.nap_s))
        return max(0.0, min(self.nap_s, left_s))
