"""Replaying trace requests through the HTTP endpoint, each twice: once with
caching off (the baseline: what the model computes alone) and once through
the fabric; the two outputs must be equal, token for token and logit for logit.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator, Sequence

from kvfabric.deploy.reference.serve.openai_bodies import KVFabricInfo
from kvfabric.deploy.serving.protocol import PrefixFetch
from kvfabric.deploy.sim.trace import TraceRequest
from kvfabric.deploy.stats import percentile
from pydantic import ValidationError
from tqdm import tqdm

from .cluster import Endpoint


class Served(KVFabricInfo):
    """One answer: the endpoint's `kvfabric` extension (validated as the ingress
    defines it) and the prompt's length."""

    prompt_tokens: int


@dataclass
class Pair:
    index: int
    baseline: Served | None = None
    fabric: Served | None = None
    error: str = ""

    @property
    def mismatch(self) -> bool:
        b, f = self.baseline, self.fabric
        return (
            b is None
            or f is None
            or (b.token_ids, b.logits_digest) != (f.token_ids, f.logits_digest)
        )


def conversations(trace: Sequence[TraceRequest], min_turns: int = 3) -> list[list[TraceRequest]]:
    """The trace's conversations of at least `min_turns` turns, by first arrival, each
    in arrival order. A request continues the earlier request it shares its longest
    hash-id prefix with (beyond the first block, which every request of this trace
    shares), if that prefix covers at least half of it."""
    conv_of: list[int] = []
    prefixes: dict[tuple[int, ...], int] = {}
    for i, r in enumerate(trace):
        h, parent = r.hash_ids, -1
        for k in range(len(h), 1, -1):
            j = prefixes.get(tuple(h[:k]))
            if j is not None:
                parent = j if 2 * k >= len(h) else -1
                break
        conv_of.append(conv_of[parent] if parent >= 0 else i)
        for k in range(2, len(h) + 1):
            prefixes.setdefault(tuple(h[:k]), i)
    members: dict[int, list[int]] = {}
    for i, c in enumerate(conv_of):
        members.setdefault(c, []).append(i)
    return [[trace[i] for i in turns] for turns in members.values() if len(turns) >= min_turns]


def multi_turn_slice(
    trace: Sequence[TraceRequest], n: int, min_turns: int = 3
) -> list[TraceRequest]:
    """About `n` requests of whole conversations (`conversations`), the earliest
    conversations first, in arrival order."""
    picked: list[TraceRequest] = []
    for turns in conversations(trace, min_turns):
        if len(picked) >= n:
            break
        picked += turns
    return sorted(picked, key=trace.index)[:n]


class Client:
    """A keep-alive HTTP client of /v1/completions, one per worker thread."""

    def __init__(self, endpoint: Endpoint, api_key: str | None, timeout_s: float = 300.0) -> None:
        self.conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout_s)
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def reconnect(self) -> None:
        """A fresh connection (after a failed request left this one in doubt)."""
        self.conn.close()
        self.conn = http.client.HTTPConnection(
            self.conn.host, self.conn.port, timeout=self.conn.timeout
        )

    def complete(
        self, model: str, tokens: list[int], max_tokens: int, cache: bool, namespace: str | None
    ) -> Served:
        """One completion; `namespace` None: the default of this client's API key."""
        # Outputs are compared bit for bit: every step's logits, hashed by the server.
        ext = {"cache": cache, "logits_digest": True} | (
            {"namespace": namespace} if namespace is not None else {}
        )
        body = json.dumps(
            {
                "model": model,
                "prompt": tokens,
                "max_tokens": max_tokens,
                "temperature": 0,
                "kvfabric": ext,
            }
        )
        self.conn.request("POST", "/v1/completions", body, self.headers)
        resp = self.conn.getresponse()
        data = json.loads(resp.read() or b"{}")
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data.get('error', data)}")
        try:
            return Served.model_validate(
                {**data["kvfabric"], "prompt_tokens": data["usage"]["prompt_tokens"]}
            )
        except (ValidationError, TypeError) as e:
            raise ValueError(f"malformed answer: {e}") from None

    def close(self) -> None:
        self.conn.close()


def replay(
    endpoint: Endpoint,
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int = 3,
    api_key: str | None = None,
    namespace: str = "demo",
    progress: bool = True,
) -> list[Pair]:
    """Each prompt baseline-then-fabric, `concurrency` prompts at a time, in order."""
    pairs = [Pair(i) for i in range(len(prompts))]
    bar = Progress(len(prompts), show=progress)

    @contextlib.contextmanager
    def worker() -> Iterator[Callable[[int], None]]:
        client = [Client(endpoint, api_key)]

        def serve(i: int) -> None:
            try:
                pairs[i].baseline = client[0].complete(
                    model, prompts[i], max_tokens, False, namespace
                )
                pairs[i].fabric = client[0].complete(model, prompts[i], max_tokens, True, namespace)
            except (OSError, RuntimeError, KeyError, ValueError) as e:
                pairs[i].error = str(e)
                client[0].close()
                client[0] = Client(endpoint, api_key)
            bar.tick()

        try:
            yield serve
        finally:
            client[0].close()

    each_in_threads(len(prompts), concurrency, worker)
    bar.end()
    return pairs


def each_in_threads(
    n: int, concurrency: int, worker: Callable[[], ContextManager[Callable[[int], None]]]
) -> None:
    """Items 0..n-1 in order, `concurrency` threads at a time; each thread serves the items
    it takes through a `worker()` of its own (one HTTP connection, say)."""
    lock, next_i = threading.Lock(), [0]

    def work() -> None:
        with worker() as serve:
            while True:
                with lock:
                    i = next_i[0]
                    next_i[0] += 1
                if i >= n:
                    return
                serve(i)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Progress:
    """A progress bar on stderr that threads tick (tqdm: off when stderr is not a
    terminal, or with `show` False)."""

    def __init__(self, total: int, label: str = "", show: bool = True) -> None:
        self.lock = threading.Lock()
        self.bar = tqdm(
            total=total,
            desc=label.strip() or None,
            file=sys.stderr,
            mininterval=0.25,
            disable=None if show else True,
        )

    def tick(self) -> None:
        with self.lock:
            self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


@dataclass
class Report:
    requests: int
    failed_requests: int
    output_mismatches: int
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    remote_hit_tokens: int
    remote_fetches: int
    remote_fetch_failures: int
    remote_bytes: int
    ttft_p50_ms_fabric: float
    ttft_p99_ms_fabric: float
    ttft_p50_ms_nocache: float
    ttft_p99_ms_nocache: float
    nodes_used: int
    extra: dict = field(default_factory=dict)

    @property
    def ttft_ratio(self) -> float:
        return (
            self.ttft_p50_ms_fabric / self.ttft_p50_ms_nocache
            if self.ttft_p50_ms_nocache
            else float("nan")
        )

    @property
    def hit_rate(self) -> float:
        hits = self.device_hit_tokens + self.host_hit_tokens + self.remote_hit_tokens
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0


def summarize(pairs: list[Pair]) -> Report:
    """Totals and percentiles; bytes moved as the model servers counted them (one
    definition: the engine's, PageBytes.fetch of the pages it fetched)."""
    ok = [
        (p, p.fabric, p.baseline) for p in pairs if p.fabric is not None and p.baseline is not None
    ]
    fab = [f for _, f, _ in ok]
    base = [b for _, _, b in ok]
    remote = sum(f.remote_tokens for f in fab)
    fetches = sum(f.fetch == PrefixFetch.FETCHED for f in fab)
    return Report(
        requests=len(pairs),
        failed_requests=len(pairs) - len(ok),
        output_mismatches=sum(p.mismatch for p, _, _ in ok),
        prompt_tokens=sum(f.prompt_tokens for f in fab),
        device_hit_tokens=sum(f.device_tokens for f in fab),
        host_hit_tokens=sum(f.host_tokens for f in fab),
        remote_hit_tokens=remote,
        remote_fetches=fetches,
        remote_fetch_failures=sum(f.fetch == PrefixFetch.FAILED for f in fab),
        remote_bytes=sum(f.fetched_bytes for f in fab),
        ttft_p50_ms_fabric=percentile([f.ttft_ms for f in fab], 0.5),
        ttft_p99_ms_fabric=percentile([f.ttft_ms for f in fab], 0.99),
        ttft_p50_ms_nocache=percentile([b.ttft_ms for b in base], 0.5),
        ttft_p99_ms_nocache=percentile([b.ttft_ms for b in base], 0.99),
        nodes_used=len({f.node for f in fab}),
    )
