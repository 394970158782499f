"""The chaos harness's requests: threads that send each prompt with caching off and through
the fabric, over and over, while faults are injected, and count what failed, what the
client or the app retried, and any output that differs from the uncached one. Which
node served each prompt last tells the harness where a fault will bite."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

from kvfabric.deploy.harness.cluster import Endpoint
from kvfabric.deploy.harness.http_replay import Client, Served

# The namespace (cache_salt) of the workload's cached requests; uncached ones use none.
NAMESPACE = "chaos"


class Workload:
    """Threads sending each prompt with caching off and through the fabric, over and
    over, until stopped; a failed request is retried (a client's retry) and counted."""

    def __init__(
        self,
        endpoint: Endpoint,
        model: str,
        prompts: list[list[int]],
        threads: int = 2,
        retries: int = 4,
        connect: Callable[[], Any] | None = None,
    ) -> None:
        """`connect`: a thread's client of the app (`complete`, `reconnect`, `close` as
        http_replay.Client's); the reference app's by default."""
        self.endpoint, self.model, self.prompts, self.retries = endpoint, model, prompts, retries
        self.connect = connect or (lambda: Client(endpoint, None, timeout_s=120))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.requests = self.failed = self.retried = self.app_retried = self.wrong = 0
        # prompt index -> the node that served its latest answer, and that answer's tokens
        # (their last page is new each time: a fetch of them reads something)
        self.served: dict[int, tuple[str, list[int]]] = {}
        self.recent: deque[str] = deque(maxlen=16)  # nodes of the latest answers
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=600)

    def served_elsewhere(self, node: str) -> list[list[int]]:
        """The tokens of latest answers that came from a node other than `node`."""
        with self._lock:
            return [t for n, t in self.served.values() if n != node]

    def busy_nodes(self) -> list[str]:
        """Nodes that served one of the latest answers: where an armed fault fires soon."""
        with self._lock:
            return sorted(set(self.recent))

    def served_by(self, node: str) -> list[list[int]]:
        """The tokens of latest answers that came from `node`."""
        with self._lock:
            return [t for n, t in self.served.values() if n == node]

    def _run(self, offset: int) -> None:
        client, i = self.connect(), offset
        try:
            while not self._stop.is_set():
                k = i % len(self.prompts)
                tokens = self.prompts[k] + self._tail(i)
                base = self._call(client, tokens, cache=False)
                fab = self._call(client, tokens, cache=True)
                with self._lock:
                    self.requests += 1
                    self.app_retried += sum(s.retries for s in (base, fab) if s is not None)
                    if base is None or fab is None:
                        self.failed += 1
                    elif (base.token_ids, base.logits_digest) != (fab.token_ids, fab.logits_digest):
                        self.wrong += 1
                    else:
                        self.served[k] = (fab.node, tokens)
                        self.recent.append(fab.node)
                i += len(self._threads)
        finally:
            client.close()

    def _tail(self, i: int, page: int = 16) -> list[int]:
        """A last page that changes from request to request, taken from the prompts'
        own tokens: every request stores something new, so puts keep reserving (and
        evicting) while the shared prefixes keep hitting."""
        source = self.prompts[(i * 7 + 3) % len(self.prompts)]
        start = (i * page) % max(1, len(source) - page)
        return list(source[start : start + page])

    def _call(self, client: Any, tokens: list[int], cache: bool) -> Served | None:
        for attempt in range(self.retries + 1):
            try:
                return client.complete(self.model, tokens, 2, cache, NAMESPACE)
            except (OSError, RuntimeError, KeyError, ValueError):
                client.reconnect()
                with self._lock:
                    self.retried += attempt == 0
                time.sleep(0.5 * (attempt + 1))
        return None
