"""The per-node engine: one request from prompt tokens to greedy output.

tokens -> local cache lookup -> remote fetch of a longer prefix when moving it
is cheaper than recomputing it -> prefill the rest in page chunks -> store the
prompt's whole pages -> greedy decode.

The cache only ever makes a request faster: a fetch that fails, or a hit the
model cannot use, degrades to recomputation and never fails the request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Mapping, Protocol, Sequence

import torch
from kvfabric.core.cache.cached_kv import CachedKV
from kvfabric.core.cache.layout import PoolName
from kvfabric.deploy.placement import CostModel, PageBytes, Prompt, plan
from kvfabric.deploy.serving.protocol import PrefixFetch

from .model import KVState, TinyLM

log = logging.getLogger(__name__)

__all__ = ["CostModel", "Engine", "EngineStats", "Generation", "RequestError"]


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, bad limits): the caller's fault."""


class KVCache(Protocol):
    """What the engine needs of a node's cache (fabric.NodeCache has it). A get
    with `lease_s` pins the hit until a put with `release` or `release_lease`. The
    engine always puts tensors (NodeCache also takes None: a cache of bytes only)."""

    def get(
        self, tokens: Sequence[int], namespace: str, lease_s: float | None = None
    ) -> CachedKV: ...
    def put(
        self,
        tokens: Sequence[int],
        kv: Sequence[torch.Tensor],
        namespace: str,
        *,
        starts: Mapping[PoolName, int] | None = None,
        release: int = 0,
    ) -> int: ...
    def release_lease(self, lease_id: int) -> bool: ...


class RemoteFetcher(Protocol):
    """Other nodes' caches, as the engine sees them (e.g. an actors.FabricClient
    bound to this node). Both answer in whole pages of `tokens`."""

    def best_remote(self, tokens: Sequence[int], namespace: str) -> int: ...
    def fetch(self, tokens: Sequence[int], namespace: str) -> int: ...


@dataclass
class EngineStats:
    """Counters since the engine started, in tokens unless named otherwise."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    hit_tokens_device: int = 0
    hit_tokens_host: int = 0
    hit_tokens_remote: int = 0
    miss_tokens: int = 0  # prompt tokens no cache served: prefilled here
    fetches: int = 0
    fetches_skipped: int = 0  # a remote had more, but recomputing was cheaper
    fetch_failures: int = 0
    fetched_bytes: int = 0  # estimated from the layout's page sizes
    unusable_hits: int = 0  # cache answers the model could not use
    stored_pages: int = 0
    lease_release_failures: int = 0  # leases left to expire: the cache did not answer

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class Generation:
    tokens: list[int]  # generated ids
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from a cache
    device_tokens: int  # ... of which: on the local device tier,
    host_tokens: int  #     loaded back from the local host tier,
    remote_tokens: int  #     and fetched from another node
    computed_tokens: int
    fetch: PrefixFetch
    stored_pages: int
    ttft_s: float
    total_s: float
    logits: list[torch.Tensor] | None = field(default=None, repr=False)


class Engine:
    """`lease_s`: how long a request's cache hit stays pinned at most, if the
    request dies before its put releases it."""

    def __init__(
        self,
        model: TinyLM,
        cache: KVCache | None = None,
        *,
        remote: RemoteFetcher | None = None,
        cost: CostModel | None = None,
        store: bool = True,
        lease_s: float = 30.0,
    ) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        self.model = model
        self.cache = cache
        self.remote = remote
        self.cost = cost if cost is not None or remote is None else CostModel.measure(model)
        self.store = store
        self.lease_s = lease_s
        self.stats = EngineStats()
        layout = self.layout = model.config.layout()
        self._sizes = PageBytes.of(layout)

    def generate(
        self,
        tokens: Sequence[int],
        max_tokens: int,
        namespace: str = "default",
        *,
        return_logits: bool = False,
    ) -> Generation:
        prompt = self._validate(tokens, max_tokens, namespace)
        start = time.perf_counter()
        # Holds this request has on its cache: its last put releases the one it
        # uses; whatever is left (a failure on the way) is released in `finally`.
        leases: list[int] = []
        try:
            past, device, host, remote, fetch = self._lookup(prompt, namespace, leases)
            logits, state = self.model.prefill(prompt, past)
            # The prompt's whole pages, before decoding appends to the state: what the
            # generated tokens' pages are recomputed from (see _store).
            ps = self.model.config.page_size
            whole = state.truncated(len(prompt) // ps * ps)
            out: list[int] = []
            steps: list[torch.Tensor] = []
            ttft = 0.0
            for i in range(max_tokens):
                if i:
                    logits = self.model.decode_step(out[-1], state)
                if return_logits:
                    steps.append(logits)
                out.append(int(torch.argmax(logits)))
                if i == 0:
                    ttft = time.perf_counter() - start
            stored = self._store(prompt, prompt + out, whole, namespace, leases)
        finally:
            self._release(leases)
        total = time.perf_counter() - start
        cached = past.length
        s = self.stats
        s.requests += 1
        s.prompt_tokens += len(prompt)
        s.generated_tokens += len(out)
        s.hit_tokens_device += device
        s.hit_tokens_host += host
        s.hit_tokens_remote += remote
        s.miss_tokens += len(prompt) - cached
        s.stored_pages += stored
        return Generation(
            out,
            len(prompt),
            cached,
            device,
            host,
            remote,
            len(prompt) - cached,
            fetch,
            stored,
            ttft if max_tokens else total,
            total,
            steps if return_logits else None,
        )

    # --- steps -----------------------------------------------------------------------
    def _validate(self, tokens: Sequence[int], max_tokens: int, namespace: str) -> list[int]:
        c = self.model.config
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise RequestError(
                f"prompt must be a sequence of token ids, got {type(tokens).__name__}"
            )
        prompt = list(tokens)
        if not prompt:
            raise RequestError("prompt is empty")
        bad = next(
            (
                t
                for t in prompt
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < c.vocab
            ),
            None,
        )
        if bad is not None:
            raise RequestError(f"token {bad!r} is not an id in [0, {c.vocab})")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise RequestError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        if len(prompt) + max_tokens > c.max_positions:
            raise RequestError(
                f"prompt of {len(prompt)} tokens plus {max_tokens} new ones exceeds "
                f"the model's {c.max_positions} positions"
            )
        if not isinstance(namespace, str) or not namespace:
            raise RequestError(f"namespace must be a non-empty string, got {namespace!r}")
        return prompt

    def _lookup(
        self, prompt: list[int], namespace: str, leases: list[int]
    ) -> tuple[KVState, int, int, int, PrefixFetch]:
        """The usable cached prefix as a model state, and where its tokens came
        from: (state, device tokens, host tokens, remote tokens, fetch outcome).
        Every hit's lease is added to `leases`."""
        if self.cache is None:
            return self.model.empty_state(), 0, 0, 0, PrefixFetch.NONE
        cached = self._get(prompt, namespace, leases)
        state = self._usable(cached)
        host = min(state.length, cached.host_tokens)
        device = state.length - host
        fetched, fetch = self._maybe_fetch(prompt, namespace, state, leases)
        if fetched is None:
            return state, device, host, 0, fetch
        return fetched, device, host, fetched.length - state.length, fetch

    def _get(self, prompt: list[int], namespace: str, leases: list[int]) -> CachedKV:
        """The local cache hit, pinned until this request's put: its lease joins `leases`."""
        assert self.cache is not None, "only an engine with a cache looks up"
        cached = self.cache.get(prompt, namespace, self.lease_s)
        if cached.lease:
            leases.append(cached.lease)
        return cached

    def _release(self, leases: list[int]) -> None:
        """Release what the puts did not (a request that failed or stored nothing).
        A cache that cannot answer now leaves them to expire: never fail for it."""
        while leases and self.cache is not None:  # leases come from a cache
            lease = leases.pop()
            try:
                self.cache.release_lease(lease)
            except Exception as e:
                self.stats.lease_release_failures += 1
                log.warning("releasing lease %d failed (it will expire): %r", lease, e)

    def _maybe_fetch(
        self, prompt: list[int], namespace: str, local: KVState, leases: list[int]
    ) -> tuple[KVState | None, PrefixFetch]:
        if self.remote is None or self.cost is None:
            return None, PrefixFetch.NONE
        ps = self.model.config.page_size
        have = local.length // ps
        # A remote node's cache is outside this process: whatever goes wrong there
        # (dead actor, timeout, a bug) must cost recomputation, not the request.
        try:
            best = min(int(self.remote.best_remote(prompt, namespace)), len(prompt) // ps)
        except Exception as e:
            self.stats.fetch_failures += 1
            log.warning("asking peers for %s's prefix failed, recomputing: %r", namespace, e)
            return None, PrefixFetch.FAILED
        if best <= have:
            return None, PrefixFetch.NONE
        if not plan(self.cost, self._sizes, Prompt(len(prompt), ps), have, best).fetched_pages:
            self.stats.fetches_skipped += 1
            return None, PrefixFetch.SKIPPED
        self.stats.fetches += 1
        try:
            got = int(self.remote.fetch(prompt, namespace))
        except Exception as e:
            log.warning("fetching %s's prefix from a peer failed, recomputing: %r", namespace, e)
            got = 0
        if got <= have:
            self.stats.fetch_failures += 1
            return None, PrefixFetch.FAILED
        # Pinned from here: the fetched prefix cannot leave before this request's put.
        state = self._usable(self._get(prompt, namespace, leases))
        if state.length <= local.length:  # evicted again before we could read it
            self.stats.fetch_failures += 1
            return None, PrefixFetch.FAILED
        self.stats.fetched_bytes += self._sizes.fetch(state.length // ps - have)
        return state, PrefixFetch.FETCHED

    def _usable(self, cached: CachedKV) -> KVState:
        try:
            return self.model.state_from_cached(cached)
        except ValueError:
            self.stats.unusable_hits += 1  # a cache bug must not become wrong output
            return self.model.empty_state()

    def _store(
        self, prompt: list[int], seq: list[int], whole: KVState, namespace: str, leases: list[int]
    ) -> int:
        """Store the whole pages of the prompt, then of prompt and output, after
        decoding (off the TTFT path): a retry repeats the prompt, a conversation's
        next turn repeats both, and the two puts keep an SWA window at each end.
        The last put releases a lease of this request's hit.

        `whole` leases the prompt's whole pages as prefill computed them. Pages past
        it (the prompt's partial page and the output) are recomputed in page
        chunks first: decoding computed them a row at a time, other bits than the
        chunk a later prefill of the same tokens runs, so storing those rows
        would not be transparent."""
        if self.cache is None or not self.store:
            return 0
        ps = self.model.config.page_size
        n = min(len(seq) // ps * ps, self.model.config.max_positions // ps * ps)
        stored = 0
        if whole.length:
            stored += self._put(
                prompt[: whole.length], whole, namespace, leases if n <= whole.length else []
            )
        if n > whole.length:
            state = self.model.prefill(seq[:n], whole)[1]
            stored += self._put(seq[:n], state, namespace, leases)
        return stored

    def _put(self, tokens: list[int], state: KVState, namespace: str, leases: list[int]) -> int:
        """Store the rows `state` has for `tokens` (never more), releasing a lease of `leases`
        (if the put fails, the lease stays in `leases` for `finally`)."""
        assert self.cache is not None, "only an engine with a cache stores"
        kv, starts = state.for_put(len(tokens), self.layout)
        stored = self.cache.put(
            tokens, kv, namespace, starts=starts, release=leases[-1] if leases else 0
        )
        if leases:
            leases.pop()
        return stored
