"""Remote hits for the scheduler side: a request whose prefix another node holds longer
than the engine's own node (by the global index's usable match) has its node pull that
prefix from the peer, and the engine keeps stepping meanwhile.

vLLM asks `get_num_new_matched_tokens` again at each step while the answer is None
("not known yet"). A request goes LOOKING (the index lookup and the node's own match
in flight) -> FETCHING (the node's fetch transaction with the peer) -> READY, each
stage under a deadline. Any failure, a deadline passed or a remote match no longer
than the local one is READY at once, never a retry: the local load path then serves
what the node holds, and vLLM computes the rest. A fetch given up on here may still
finish in the node; its transaction commits whole or not at all either way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, Sequence

from kvfabric.core.exchange.destination import FetchOutcome
from kvfabric.core.index.answers import NodeMatch
from kvfabric.deploy.serving.engine_identity import is_engine

from .jobs import FabricSettings

log = logging.getLogger(__name__)
# An engine with nothing scheduled waits this long for a fabric answer rather than spin
# (its scheduler loop would otherwise take the CPU the node and the index need).
IDLE_WAIT_S = 0.01
SETTLE_ROUNDS = 8  # a lookup's calls (shards, the node's match) answered within one admission


class Stage(str, Enum):
    LOOKING = "looking"
    FETCHING = "fetching"
    READY = "ready"


class PendingLookup(Protocol):
    @property
    def pending(self) -> Any: ...  # the call it waits on now (None once answered)

    def poll(self) -> list[NodeMatch] | None: ...


class RemoteLink(Protocol):
    """What RemoteFetches needs of NodeLink (a fake one at the edge of unit tests)."""

    name: str

    def index_ready(self) -> bool: ...
    def start_lookup(self, tokens: Sequence[int], namespace: str) -> PendingLookup: ...
    def submit(self, method: str, *args: Any) -> Any: ...
    def start_fetch(self, peer: str, tokens: Sequence[int], namespace: str) -> Any: ...
    def finished(self, calls: list) -> list: ...
    def result(self, call: Any) -> Any: ...
    def wait_any(self, calls: list, timeout_s: float) -> int: ...


@dataclass
class RemoteStats:
    lookups: int = 0  # requests the index was asked about
    fetches: int = 0  # fetches started from a peer
    committed: int = 0  # of those, committed into the node
    failures: int = 0  # lookups or fetches that failed or ran past their deadline


@dataclass
class RemoteFetch:
    """One request's way through the stages."""

    stage: Stage
    deadline: float
    lookup: PendingLookup | None = None
    local_call: Any = None
    local_pages: int | None = None  # the node's own usable match before any fetch
    matches: list[NodeMatch] | None = None
    fetch_call: Any = None
    peer: str = ""
    outcome: str = ""  # a FetchOutcome value, or why it stopped

    @property
    def committed(self) -> bool:
        return self.outcome == FetchOutcome.COMMITTED.value

    def pending(self) -> list:
        calls = [self.fetch_call] if self.stage is Stage.FETCHING else []
        if self.stage is Stage.LOOKING:
            calls = [
                c
                for c in (
                    self.lookup.pending if self.lookup is not None else None,
                    None if self.local_pages is not None else self.local_call,
                )
                if c is not None
            ]
        return calls


class RemoteFetches:
    def __init__(self, link: RemoteLink, settings: FabricSettings, stats: RemoteStats) -> None:
        self.link = link
        self.settings = settings
        self.requests: dict[str, RemoteFetch] = {}
        self.stats = stats
        self.clock = time.monotonic

    def ready(self, rid: str, tokens: Sequence[int], namespace: str, skip_pages: int) -> bool:
        """Whether the request may go on to the local load path now (False: ask again
        at a later step)."""
        rec = self.requests.get(rid)
        settle_by = 0.0
        if rec is None:
            rec = self.requests[rid] = self._start(tokens, namespace)
            # A lookup answers in milliseconds; waiting that long beats a whole engine step
            # (a busy engine's step is a prefill: seconds on a CPU).
            settle_by = self.clock() + self.settings.lookup_wait_s
        for _ in range(SETTLE_ROUNDS):
            try:
                self._advance(rec, tokens, namespace, skip_pages)
            except Exception as e:  # any failure: the request computes what the node lacks
                self._give_up(rec, f"{rec.stage.value} failed: {e!r}")
            if rec.stage is not Stage.LOOKING or self.clock() >= settle_by:
                break
            calls = rec.pending()  # none: answered, not read yet
            if calls and not self.wait_for(calls, settle_by - self.clock()):
                break
        if rec.stage is not Stage.READY and self.clock() >= rec.deadline:
            self._give_up(rec, f"{rec.stage.value} past its deadline")
        return rec.stage is Stage.READY

    def fetched_pages(self, rid: str, pages: int, first_page: int) -> int:
        """Of a local hit of pages [first_page, pages), how many the request's fetch brought."""
        rec = self.requests.get(rid)
        if rec is None or not rec.committed or rec.local_pages is None:
            return 0
        return max(0, pages - max(first_page, rec.local_pages))

    def node_holds(self, rid: str) -> int | None:
        """The node's own usable match for the request as its lookup found it; None when
        it was not asked, or a fetch started since (the node may hold more now)."""
        rec = self.requests.get(rid)
        if rec is None or rec.fetch_call is not None:
            return None
        return rec.local_pages

    def forget(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def forget_lookup(self, rid: str) -> None:
        """Drop the request's lookup, unless its fetch is in flight: the next `ready`
        asks the index and the node again."""
        rec = self.requests.get(rid)
        if rec is not None and rec.fetch_call is None:
            del self.requests[rid]

    def wait_for(self, calls: list, timeout_s: float) -> bool:
        """Whether one of `calls` answered within `timeout_s`."""
        try:
            return bool(self.link.wait_any(calls, timeout_s))
        except Exception as e:  # the next poll sees the same failure and gives up
            log.debug("waiting on the fabric failed: %r", e)
            return False

    def wait_if_idle(self, scheduled_tokens: int, others: Sequence[Any] = ()) -> None:
        """With nothing scheduled, wait a little for the first fabric answer (of these
        requests' lookups and fetches, or `others`: the admission's load calls and the
        saves' store calls)."""
        if scheduled_tokens:
            return
        calls = [c for rec in self.requests.values() for c in rec.pending()] + list(others)
        if calls:
            self.wait_for(calls, IDLE_WAIT_S)

    # --- stages --------------------------------------------------------------------------
    def _start(self, tokens: Sequence[int], namespace: str) -> RemoteFetch:
        rec = RemoteFetch(Stage.LOOKING, self.clock() + self.settings.timeout_s)
        try:
            if not self.link.index_ready():
                rec.stage, rec.outcome = Stage.READY, "no index"
                return rec
            self.stats.lookups += 1
            rec.lookup = self.link.start_lookup(tokens, namespace)
            rec.local_call = self.link.submit("match", list(tokens), namespace)
        except Exception as e:
            self._give_up(rec, f"lookup failed to start: {e!r}")
        return rec

    def _advance(
        self, rec: RemoteFetch, tokens: Sequence[int], namespace: str, skip_pages: int
    ) -> None:
        if rec.stage is Stage.LOOKING:
            if rec.local_pages is None and self.link.finished([rec.local_call]):
                rec.local_pages = int(self.link.result(rec.local_call))
            if rec.matches is None:
                assert rec.lookup is not None, "a request looking has its lookup started"
                rec.matches = rec.lookup.poll()
            if rec.local_pages is None or rec.matches is None:
                return
            # Only node actors serve fetches: an engine's own device cache is indexed too
            # (serving/engine_identity.py), but nothing can read from it.
            best = next(
                (m for m in rec.matches if m.node != self.link.name and not is_engine(m.node)), None
            )
            if best is None or best.pages <= max(rec.local_pages, skip_pages):
                rec.stage, rec.outcome = Stage.READY, "no longer match elsewhere"
                return
            rec.peer = best.node
            rec.stage, rec.deadline = Stage.FETCHING, self.clock() + self.settings.fetch_timeout_s
            self.stats.fetches += 1
            rec.fetch_call = self.link.start_fetch(best.node, tokens, namespace)
        if rec.stage is Stage.FETCHING:
            if not self.link.finished([rec.fetch_call]):
                return
            rec.stage, rec.outcome = (
                Stage.READY,
                str(FetchOutcome(self.link.result(rec.fetch_call)).value),
            )
            if rec.committed:
                self.stats.committed += 1
            elif rec.outcome != FetchOutcome.NOTHING_TO_FETCH.value:
                self.stats.failures += 1
                log.info("fabric fetch from %s: %s", rec.peer, rec.outcome)

    def _give_up(self, rec: RemoteFetch, why: str) -> None:
        self.stats.failures += 1
        log.warning("fabric remote hit given up: %s", why)
        rec.stage, rec.outcome = Stage.READY, why
