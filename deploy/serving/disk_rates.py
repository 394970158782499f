"""Each node's disk read bandwidth as the node measured it at start (actors/node/disk.py),
as a router learns it: asked of the node the first time the node is a candidate, in the
background. Until an answer comes (or after an ask failed) a node's rate is 0.0, which the
cost model reads as its own nominal figure; a failed ask is tried again after `retry_s`."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Iterable

log = logging.getLogger(__name__)
ASK_S = 10.0  # an ask not answered by then failed (a node restarting, say)

# Asks the node actor of that name for its measured rate.
Ask = Callable[[str], Awaitable[float]]


class DiskRates:
    """Node actor name -> its disk's read bytes/s, as far as learned. One event loop's."""

    def __init__(self, ask: Ask, retry_s: float, ask_s: float = ASK_S) -> None:
        self._ask = ask
        self._retry_s = retry_s
        self._ask_s = ask_s
        self._rates: dict[str, float] = {}
        self._asking: dict[str, asyncio.Task[None]] = {}
        self._next_try: dict[str, float] = {}  # a node whose ask failed, when to ask again

    async def of(self, nodes: Iterable[str], wait_s: float) -> dict[str, float]:
        """Each node's rate, 0.0 where not known. Nodes not asked yet are asked now, and
        those asks waited for at most `wait_s` (the rest answer for later requests)."""
        nodes = list(nodes)
        started = [self._start(n) for n in set(nodes) if self._due(n)]
        if started and wait_s > 0:
            await asyncio.wait(started, timeout=wait_s)
        return {n: self._rates.get(n, 0.0) for n in nodes}

    def _due(self, node: str) -> bool:
        return (
            node not in self._rates
            and node not in self._asking
            and time.monotonic() >= self._next_try.get(node, 0.0)
        )

    def _start(self, node: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(self._learn(node))
        self._asking[node] = task
        return task

    async def _learn(self, node: str) -> None:
        try:
            self._rates[node] = float(await asyncio.wait_for(self._ask(node), self._ask_s))
        except Exception as e:  # a rate unknown only costs the nominal figure
            self._next_try[node] = time.monotonic() + self._retry_s
            log.info("node %s did not say its disk read bandwidth (%r): nominal for now", node, e)
        finally:
            self._asking.pop(node, None)
