"""`kvfabric demo --disk`: every node actor of the fabric is killed mid-pass (as a crash:
nothing flushed) and Ray restarts it; the new actor adopts the pages its disk tier holds
and the index finds them again. The figure: the hit rate of the requests sent once every
node is back, against that of the requests finished before the restart (the same number
of each). Without a disk tier (`--restart-after` alone) the same restart starts the nodes
cold, which is the comparison.

On a conversation trace that ratio says little of the disk: the turns after the restart
mostly need what was saved after it (the same run without a disk gave 1.00, 2026-12-06).
So the demo then sends the 50 requests before the restart again, once the pass has ended
(a revisit): their prompts were stored before the restart, so they hit only where the
restarted nodes adopted them from disk (the engines' own caches hold one prompt each), and
their outputs must equal the uncached ones."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from .conversation import PassResult, Turn

WINDOW = 50  # requests each side of the restart
BACK_WAIT_S = 180.0  # a restarted actor opens its disk store and rejoins the index


@dataclass(frozen=True)
class WarmRestart:
    after_requests: int  # the restart began once this many requests had finished
    restart_s: float  # from the kills until every node actor answered, attached again
    adopted_pages: int  # what the restarted actors found on their disks, all nodes
    window: int  # requests each side (fewer when the pass had fewer)
    hit_rate_before: float
    hit_rate_after: float
    before: tuple[tuple[int, int], ...] = ()  # (conversation, turn) of the window before
    revisit_hit_rate: float | None = None  # of those requests, sent again after the pass
    revisit_mismatches: int = 0  # of those, outputs differing from the uncached (or failed)

    @property
    def ratio(self) -> float:
        return self.hit_rate_after / self.hit_rate_before if self.hit_rate_before else 0.0

    def line(self) -> str:
        revisit = (
            ""
            if self.revisit_hit_rate is None
            else f"; the {self.window} before, sent again after the pass: hit rate "
            f"{self.revisit_hit_rate:.1%}, {self.revisit_mismatches} outputs differing from "
            f"caching off"
        )
        return (
            f"every node actor restarted after {self.after_requests} requests (back in "
            f"{self.restart_s:.1f} s, {self.adopted_pages} pages adopted from disk): hit rate "
            f"{self.hit_rate_before:.1%} of the {self.window} requests before, "
            f"{self.hit_rate_after:.1%} of the {self.window} after (ratio {self.ratio:.2f}, "
            f"target >= 0.9){revisit}"
        )

    def revisited(self, result: PassResult, reference: dict) -> WarmRestart:
        """With the revisit pass `result`, whose request i re-sent `self.before[i]`;
        `reference`: the uncached outputs by (conversation, turn)."""
        done = result.done
        wrong = sum(1 for t in done if t.token_ids != reference.get(self.before[t.conversation]))
        return dataclasses.replace(
            self, revisit_hit_rate=_hit_rate(done), revisit_mismatches=wrong + result.failed
        )

    def as_json(self) -> dict:
        return {
            "after_requests": self.after_requests,
            "restart_s": round(self.restart_s, 2),
            "adopted_pages": self.adopted_pages,
            "window": self.window,
            "hit_rate_before": round(self.hit_rate_before, 4),
            "hit_rate_after": round(self.hit_rate_after, 4),
            "ratio": round(self.ratio, 3),
            "revisit_hit_rate": None
            if self.revisit_hit_rate is None
            else round(self.revisit_hit_rate, 4),
            "revisit_mismatches": self.revisit_mismatches,
        }


class Restarter:
    """The replay's `on_done` hook: when the `after`-th request finishes, restart every
    node actor of `model_id`'s fabrics (in that sender's thread; the others go on)."""

    def __init__(self, model_id: str, after: int) -> None:
        self.model_id = model_id
        self.after = after
        self.began = self.ended = 0.0  # time.perf_counter(), as the replay's turns
        self.adopted = 0
        self.error = ""
        self._done = threading.Event()

    def __call__(self, finished: int) -> None:
        if finished != self.after:
            return
        self.began, self.error = time.perf_counter(), ""
        try:
            self.adopted = restart_node_actors(self.model_id)
        except Exception as e:  # the figure is lost, not the pass: the report says why
            self.error = repr(e)[:300]
        self.ended = time.perf_counter()
        self._done.set()

    def report(self, result: PassResult) -> WarmRestart | None:
        """The figure from the pass's turns; None (the reason in `error`) when the restart
        did not happen or failed."""
        if not self._done.is_set():
            self.error = self.error or f"the pass ended before {self.after} requests finished"
            return None
        if self.error:
            return None
        before = sorted((t for t in result.done if t.done_at <= self.began), key=_done_at)
        after = sorted((t for t in result.done if t.sent_at >= self.ended), key=_sent_at)
        window = min(WINDOW, len(before), len(after))
        if window == 0:
            self.error = "no request finished before the restart or was sent after it"
            return None
        return WarmRestart(
            self.after,
            self.ended - self.began,
            self.adopted,
            window,
            _hit_rate(before[-window:]),
            _hit_rate(after[:window]),
            tuple((t.conversation, t.turn) for t in before[-window:]),
        )


def restart_node_actors(model_id: str, wait_s: float = BACK_WAIT_S) -> int:
    """Kill every node actor of `model_id`'s fabrics at once (Ray restarts them) and wait
    until each answers with a newer epoch, attached to the index; returns the pages they
    adopted from their disks."""
    import ray
    from kvfabric.actors.directory import CALL_TIMEOUT_S, DIRECTORY
    from kvfabric.actors.served import fabrics_of

    actors: list = []
    for namespace in fabrics_of(model_id):
        directory = ray.get_actor(DIRECTORY, namespace=namespace)
        names = cast(list[str], ray.get(directory.node_names.remote(), timeout=CALL_TIMEOUT_S))
        actors += [ray.get_actor(name, namespace=namespace) for name in names]
    epochs = [ray.get(a.heartbeat.remote(), timeout=CALL_TIMEOUT_S).epoch for a in actors]
    for actor in actors:
        ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + wait_s
    for actor, epoch in zip(actors, epochs):
        while not _back(actor, epoch):
            if time.monotonic() > deadline:
                raise TimeoutError(f"a node actor was not back within {wait_s:.0f} s")
            time.sleep(0.2)
    stats = ray.get([a.stats.remote() for a in actors], timeout=CALL_TIMEOUT_S)
    return sum(int(s.get("adopted_pages", 0)) for s in stats)


def _back(actor, epoch: int) -> bool:
    import ray
    from kvfabric.actors.directory import CALL_TIMEOUT_S
    from ray.exceptions import GetTimeoutError, RayError

    try:
        beat = ray.get(actor.heartbeat.remote(), timeout=CALL_TIMEOUT_S)
    except (RayError, GetTimeoutError):
        return False  # still restarting
    return bool(beat.epoch > epoch and beat.attached)


def _hit_rate(turns: list[Turn]) -> float:
    return sum(t.cached_tokens for t in turns) / max(1, sum(t.prompt_tokens for t in turns))


def _done_at(t: Turn) -> float:
    return t.done_at


def _sent_at(t: Turn) -> float:
    return t.sent_at
