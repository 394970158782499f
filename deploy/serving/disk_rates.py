"""Each node's disk read bandwidth as the node measured it at start (actors/node/disk.py),
as a router learns it: asked of the node the first time the node is a candidate, in the
background. Until an answer comes (or after an ask failed) a node's rate is 0.0, which the
cost model reads as its own nominal figure; a failed ask is tried again after `retry_s`.
A node measures again when its actor restarts (on another disk, perhaps), so a learned
rate is asked again after `refresh_s`, the old one answering until the new one comes."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Awaitable, Callable, Iterable

log = logging.getLogger(__name__)
ASK_S = 10.0  # an ask not answered by then failed (a node restarting, say)
REFRESH_S = 60.0  # a learned rate is asked again this long after it came

# Asks the node actor of that name for its measured rate.
Ask = Callable[[str], Awaitable[float]]


class DiskRates:
    """Node actor name -> its disk's read bytes/s, as far as learned. One event loop's."""

    def __init__(
        self,
        ask: Ask,
        retry_s: float,
        ask_s: float = ASK_S,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ask = ask
        self._clock = clock
        self._retry_s = retry_s
        self._ask_s = ask_s
        self._refresh_s = refresh_s
        self._rates: dict[str, float] = {}
        self._asking: dict[str, asyncio.Task[None]] = {}
        self._next_try: dict[str, float] = {}  # when to ask a node next (again)

    async def of(self, nodes: Iterable[str], wait_s: float) -> dict[str, float]:
        """Each node's rate, 0.0 where not known. Nodes due are asked now; the asks of
        nodes with no rate yet are waited for at most `wait_s` (the rest answer for later
        requests)."""
        nodes = list(nodes)
        started = {n: self._start(n) for n in set(nodes) if self._due(n)}
        # A node known already answers its last rate while it is asked again: not waited for.
        new = [task for n, task in started.items() if n not in self._rates]
        if new and wait_s > 0:
            await asyncio.wait(new, timeout=wait_s)
        return {n: self._rates.get(n, 0.0) for n in nodes}

    def _due(self, node: str) -> bool:
        return node not in self._asking and self._clock() >= self._next_try.get(node, 0.0)

    def _start(self, node: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(self._learn(node))
        self._asking[node] = task
        return task

    async def _learn(self, node: str) -> None:
        try:
            rate = await asyncio.wait_for(self._ask(node), self._ask_s)
            # A node's answer is input from another process: a number of bytes/s or nothing.
            if type(rate) not in (int, float) or not math.isfinite(rate) or rate < 0:
                raise ValueError(f"not a read bandwidth: {rate!r:.40}")
            self._rates[node] = float(rate)
            self._next_try[node] = self._clock() + self._refresh_s
        except Exception as e:  # a rate unknown only costs the nominal figure (or the last)
            self._next_try[node] = self._clock() + self._retry_s
            log.info("node %s did not say its disk read bandwidth (%r): nominal for now", node, e)
        finally:
            self._asking.pop(node, None)
