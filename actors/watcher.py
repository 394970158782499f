"""The directory's watcher: a thread of the directory actor that runs a membership pass
every `watch_s` seconds, starts node actors for new Ray nodes on the side (that takes a
while, and drops must not wait for it), and rebalances the index every REBALANCE_EVERY_S.

The directory holds one Watcher and hands it its membership passes and its rebalance."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol

from .membership import START_TIMEOUT_S, MembershipPasses

REBALANCE_EVERY_S = 10.0  # the watcher's rebalance period
REBALANCE_SIGMAS = 3.0  # its bar for uneven lookups (see kvfabric.core.index.balance.chance_target)
log = logging.getLogger(__name__)


class Rebalance(Protocol):
    """The directory's rebalance: whether routes changed (see FabricDirectory.rebalance)."""

    def __call__(self, *, sigmas: float) -> bool: ...


class Watcher:
    def __init__(
        self,
        membership: MembershipPasses,
        rebalance: Rebalance,
        route_version: Callable[[], int],
    ) -> None:
        """`route_version`: the directory's route table's version (for the log)."""
        self.membership = membership
        self.rebalance = rebalance
        self.route_version = route_version
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def watch(self, every_s: float) -> None:
        """Reconcile every `every_s` seconds from now on, in a thread of this actor."""
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s!r}")
        if self._watcher is not None and not self._watcher.is_alive():
            self._watcher = None  # stopped: start again
        if self._watcher is None:
            self._stop.clear()
            self._watcher = threading.Thread(
                target=self._watch, args=(every_s,), daemon=True, name="kvf-membership"
            )
            self._watcher.start()

    def _watch(self, every_s: float) -> None:
        balance_at = time.monotonic() + REBALANCE_EVERY_S
        adding: threading.Thread | None = None
        while not self._stop.wait(every_s):
            try:
                changed = self.membership.reconcile(add=False)
                if changed.dropped or changed.rejoined:
                    log.info(
                        "membership: dropped %s, rejoined %s", changed.dropped, changed.rejoined
                    )
            except Exception as e:  # the watcher must outlive any one bad pass
                log.warning("membership pass failed: %s", e)
            # Starting a node actor takes a while (torch, NIXL): drops must not wait for it.
            if adding is None or not adding.is_alive():
                adding = threading.Thread(target=self._add_pass, daemon=True, name="kvf-adding")
                adding.start()
            if time.monotonic() >= balance_at:
                # Also what keeps the shards' load counts short: each pass takes them.
                balance_at = time.monotonic() + REBALANCE_EVERY_S
                try:
                    if self.rebalance(sigmas=REBALANCE_SIGMAS):
                        log.info("rebalanced: routes version %d", self.route_version())
                except Exception as e:
                    log.warning("rebalance pass failed: %s", e)

    def _add_pass(self) -> None:
        try:
            added = self.membership.add_missing(START_TIMEOUT_S)
            if added:
                log.info("membership: added %s", added)
        except Exception as e:  # the next pass tries again
            log.warning("adding node actors failed: %s", e)

    def stop_watching(self, wait_s: float = 0.0) -> bool:
        """Stop the watcher once its pass in progress ends, waiting up to `wait_s` for
        that; returns whether it has stopped. `watch` starts it again."""
        self._stop.set()
        if self._watcher is not None and wait_s > 0:
            self._watcher.join(wait_s)
        return self._watcher is None or not self._watcher.is_alive()
