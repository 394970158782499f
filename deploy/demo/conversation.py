"""Multi-turn conversations of a trace replayed through an OpenAI endpoint as text,
streamed, so time to first token is measured as a client sees it.

Each conversation's turns go in order (a user's next turn follows the answer), several
conversations at once. The text of a trace block depends only on its hash id, so turns
of one conversation share their earlier blocks' text, and the byte-level tokenizer of
the demo's model makes one token of each character.

With `arrivals`, each conversation's first turn is sent at its own time after the pass
starts, whatever is in flight (open loop: the load mode's single-turn requests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from kvfabric.deploy.harness.cluster import Endpoint
from kvfabric.deploy.harness.http_replay import Progress, each_in_threads
from kvfabric.deploy.sim.trace import TraceRequest, request_tokens
from kvfabric.deploy.stats import percentile

# Printable ASCII without the characters a tokenizer or JSON might treat specially.
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:-"


def conversation_texts(
    convs: Sequence[Sequence[TraceRequest]], chars_per_block: int, max_chars: int
) -> list[list[str]]:
    """Each turn's prompt: its blocks' text (`chars_per_block` a block), cut to `max_chars`."""
    return [[_text(r, chars_per_block)[:max_chars] for r in turns] for turns in convs]


def single_turn_texts(
    requests: Sequence[TraceRequest], chars_per_block: int, max_chars: int
) -> list[str]:
    """Each request's blocks' text with a first block of its own (a hash id no request
    of `requests` has), so no prompt shares a prefix with another: all misses."""
    fresh = 1 + max((h for r in requests for h in r.hash_ids), default=0)
    return [
        _text(dataclasses.replace(r, hash_ids=(fresh + i,) + r.hash_ids[1:]), chars_per_block)[
            :max_chars
        ]
        for i, r in enumerate(requests)
    ]


def _text(r: TraceRequest, chars_per_block: int) -> str:
    ids = request_tokens(r, chars_per_block, vocab_size=len(ALPHABET))
    return "".join(ALPHABET[i] for i in ids)


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    error: str = ""
    # time.perf_counter() when the request was sent, its last token came, its stream ended
    sent_at: float = 0.0
    last_token_at: float = 0.0
    done_at: float = 0.0

    @property
    def e2e_ms(self) -> float:
        return (self.done_at - self.sent_at) * 1000

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first, from the stream's chunk times; NaN
        with one token."""
        if len(self.token_ids) < 2:
            return math.nan
        decode_ms = (self.last_token_at - self.sent_at) * 1000 - self.ttft_ms
        return decode_ms / (len(self.token_ids) - 1)


@dataclass
class PassResult:
    name: str
    turns: list[Turn]
    wall_s: float
    send_lag_ms: float = 0.0  # open loop: the most a request was sent after its arrival time

    @property
    def done(self) -> list[Turn]:
        return [t for t in self.turns if not t.error]

    @property
    def failed(self) -> int:
        return len(self.turns) - len(self.done)

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.done)

    @property
    def cached_tokens(self) -> int:
        return sum(t.cached_tokens for t in self.done)

    def ttft_ms(self, q: float) -> float:
        return percentile([t.ttft_ms for t in self.done], q)

    def outputs(self) -> dict[tuple[int, int], list[int]]:
        return {(t.conversation, t.turn): t.token_ids for t in self.done}


class StreamingClient:
    """The `openai` client of /v1/completions, streaming each answer. It does not retry:
    a failed request is the pass's to count."""

    def __init__(self, endpoint: Endpoint, model: str, timeout_s: float = 300.0) -> None:
        import openai

        self.model = model
        self.client = openai.OpenAI(
            base_url=f"http://{endpoint.host}:{endpoint.port}/v1",
            api_key="unused",  # the demo's apps take no key
            timeout=timeout_s,
            max_retries=0,
        )

    def complete(self, prompt: str, max_tokens: int, salt: str | None, into: Turn) -> None:
        """Greedy completion of `prompt`; fills `into` (TTFT: the first chunk with a token)."""
        extra: dict = {"return_token_ids": True, "ignore_eos": True}
        if salt is not None:
            extra["cache_salt"] = salt
        start = into.sent_at = time.perf_counter()
        stream = self.client.completions.create(
            model=self.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        with stream:
            for chunk in stream:
                for choice in chunk.choices:
                    ids = getattr(choice, "token_ids", None) or []  # vLLM's field
                    if ids or choice.text:
                        into.last_token_at = time.perf_counter()
                        if not into.ttft_ms:
                            into.ttft_ms = (into.last_token_at - start) * 1000
                    into.token_ids += ids
                if chunk.usage is not None:
                    into.prompt_tokens = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    into.cached_tokens = (details.cached_tokens if details else 0) or 0
        into.done_at = time.perf_counter()
        if not into.token_ids or not into.prompt_tokens:
            raise ValueError("the stream ended without tokens or usage")

    def close(self) -> None:
        self.client.close()


def replay_conversations(
    name: str,
    endpoint: Endpoint,
    model: str,
    texts: list[list[str]],
    max_tokens: int,
    concurrency: int,
    uncached: bool = False,
    progress: bool = True,
    arrivals: Sequence[float] | None = None,
    on_done: Callable[[int], None] | None = None,
) -> PassResult:
    """Every conversation's turns in order, `concurrency` conversations at a time.
    `uncached`: each request gets a cache_salt of its own, so nothing cached can match.
    `arrivals`: each conversation's first turn waits until that many seconds after the
    pass starts (open loop while `concurrency` senders are free; the lag is reported).
    `on_done`: told, in the sender's thread, how many requests have finished (failed ones
    too) as each finishes; the other senders go on meanwhile."""
    turns = [Turn(c, k) for c, conv in enumerate(texts) for k in range(len(conv))]
    by_conv: dict[int, list[Turn]] = {}
    for t in turns:
        by_conv.setdefault(t.conversation, []).append(t)
    bar = Progress(len(turns), f"{name:<10} ", show=progress)
    lags = [0.0] * len(texts)
    finished = [0]
    count = threading.Lock()
    # One client (connection) a sender, made before the clock starts: making tens of
    # them at once takes a second, which would make the first arrivals late.
    clients: queue.SimpleQueue[StreamingClient] = queue.SimpleQueue()
    for _ in range(max(1, concurrency)):  # each_in_threads' threads
        clients.put(StreamingClient(endpoint, model))

    @contextlib.contextmanager
    def worker() -> Iterator[Callable[[int], None]]:
        client = clients.get_nowait()

        def serve(c: int) -> None:
            if arrivals is not None:
                due = start + arrivals[c]
                time.sleep(max(0.0, due - time.perf_counter()))
                lags[c] = max(0.0, time.perf_counter() - due) * 1000
            for t in by_conv[c]:
                salt = f"nocache-{uuid.uuid4().hex}" if uncached else None
                try:
                    client.complete(texts[c][t.turn], max_tokens, salt, t)
                except Exception as e:  # any failure is this request's, counted, not the run's
                    t.error = repr(e)[:300]
                bar.tick()
                if on_done is not None:
                    with count:
                        finished[0] += 1
                        n = finished[0]
                    on_done(n)

        try:
            yield serve
        finally:
            client.close()

    start = time.perf_counter()
    each_in_threads(len(texts), concurrency, worker)
    bar.end()
    return PassResult(name, turns, time.perf_counter() - start, max(lags, default=0.0))
