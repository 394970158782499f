"""The tiny reference transformer: decoder-only, full and sliding-window layers,
GQA, rotary positions, a real KV cache, seeded weights (no files to load).

Cache transparency is the point of this model. In fp32 on CPU an operation gives
the same bits for the same inputs *and the same shapes*; change a shape (16
query rows instead of 1, 80 keys instead of 32) and the summation order, and so
the bits, may change. So every computation here has shapes that depend only on
token positions, never on how much of the prompt came from a cache:

- Prefill runs in chunks aligned to pages (chunk i covers tokens
  [i*page_size, (i+1)*page_size), the last one may be shorter), whether a
  prefix was cached or not. A whole page's K/V is therefore always the output of
  the same chunk computation, whichever request computed it.
- A chunk or step at position c attends to keys [0, end) in full layers and
  [max(0, c - window + 1), end) in SWA layers: a fixed range, even when the
  state holds more (or, from a cache, less) SWA history.
- The prompt's last-token logits always come from one decode-shaped step over
  the K/V of the tokens before it, so a fully cached prompt gives the same
  logits as a computed one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from kvfabric.core.cache.cached_kv import CachedKV
from kvfabric.core.cache.layout import KVLayout, LayerKind, LayoutError, PoolName
from kvfabric.core.wire import is_int


class ModelConfigError(ValueError):
    """A model config with a field of the wrong type or range, or fields that do not fit
    together."""


_KINDS = tuple(k.value for k in LayerKind)


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    d_model: int = 64
    n_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    layers: tuple[str, ...] = ("full", "swa", "full", "swa")
    window: int = 32  # SWA: a token at p attends to (p - window, p]
    page_size: int = 16
    max_positions: int = 1024
    rope_base: float = 10_000.0
    eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab",
            "d_model",
            "n_heads",
            "kv_heads",
            "head_dim",
            "ffn",
            "page_size",
            "max_positions",
        ):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ModelConfigError(f"{name} must be a positive int, got {value!r}")
        if self.n_heads % self.kv_heads:
            raise ModelConfigError(
                f"n_heads {self.n_heads} must be a multiple of kv_heads {self.kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"rotary positions need an even head_dim, got {self.head_dim}")
        ok = isinstance(self.layers, (tuple, list)) and all(
            isinstance(k, str) and k in _KINDS for k in self.layers
        )
        if not ok:
            raise ModelConfigError(f"layers must be a sequence of {_KINDS}, got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(self.layers))  # hashable, like the default
        if not is_int(self.window) or self.window < 0:
            raise ModelConfigError(f"window must be an int >= 0, got {self.window!r}")
        for name in ("rope_base", "eps"):
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not 0 < value < math.inf
            ):
                raise ModelConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 1 << 64:
            raise ModelConfigError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        try:
            self.layout()  # the layout validates layer kinds and the window
        except LayoutError as e:
            raise ModelConfigError(f"bad layout: {e}") from None

    def layout(self) -> KVLayout:
        """The KV layout of this model, for NodeCache and the fabric."""
        has_swa = LayerKind.SWA in {LayerKind(k) for k in self.layers}
        return KVLayout(
            layers=tuple(LayerKind(k) for k in self.layers),
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            window=self.window if has_swa else 0,
            dtype="float32",
        )


@dataclass
class KVState:
    """K/V of positions [0, length). Layer i holds [starts[i], length) as a
    [2, length - starts[i], kv_heads, head_dim] tensor: full layers start at 0,
    SWA layers may start later (a cache keeps only their window)."""

    layers: list[torch.Tensor]
    starts: list[int]
    length: int

    def truncated(self, tokens: int) -> "KVState":
        """The state of the first `tokens` positions (views, no copy)."""
        if not 0 <= tokens <= self.length or any(s > tokens for s in self.starts):
            raise ValueError(
                f"cannot cut a state of {self.length} tokens (starts {self.starts}) at {tokens}"
            )
        return KVState(
            [t[:, : tokens - s] for t, s in zip(self.layers, self.starts)],
            list(self.starts),
            tokens,
        )

    def for_put(
        self, tokens: int, layout: KVLayout
    ) -> tuple[list[torch.Tensor], dict[PoolName, int]]:
        """What NodeCache.put takes for the first `tokens` positions: per layer
        the rows it holds, and per pool the token position they start at.

        Only rows this state computed or loaded are handed over, never padding:
        a pool's rows start at the latest start among its layers, rounded up to
        a whole page (SWA layers of a state built on a cache hit start at the
        hit's window)."""
        if not 0 <= tokens <= self.length:
            raise ValueError(f"cannot export {tokens} tokens of a state of {self.length}")
        ps = layout.page_size
        layers = list(self.layers)
        starts: dict[PoolName, int] = {}
        for pool in layout.pools:
            of = layout.layers_of(pool)
            start = min(tokens, -(-max(self.starts[i] for i in of) // ps) * ps)
            starts[pool] = start
            for i in of:
                s = self.starts[i]
                layers[i] = self.layers[i][:, start - s : tokens - s].contiguous()
        return layers, starts


class TinyLM:
    """Weights are plain tensors drawn from a seeded generator: the same config
    gives the same model in every process, on every node."""

    def __init__(
        self, config: ModelConfig = ModelConfig(), device: torch.device | str = "cpu"
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.kinds = tuple(LayerKind(k) for k in config.layers)
        c = config
        g = torch.Generator().manual_seed(c.seed)

        def w(*shape: int, std: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * std).to(self.device)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device)

        d, hd = c.d_model, c.head_dim
        self.embed = w(c.vocab, d, std=1.0)
        self.blocks = [
            {
                "attn_norm": ones(d),
                "wq": w(d, c.n_heads * hd, std=d**-0.5),
                "wk": w(d, c.kv_heads * hd, std=d**-0.5),
                "wv": w(d, c.kv_heads * hd, std=d**-0.5),
                "wo": w(c.n_heads * hd, d, std=(c.n_heads * hd) ** -0.5),
                "mlp_norm": ones(d),
                "w_gate": w(d, c.ffn, std=d**-0.5),
                "w_up": w(d, c.ffn, std=d**-0.5),
                "w_down": w(c.ffn, d, std=c.ffn**-0.5),
            }
            for _ in c.layers
        ]
        self.final_norm = ones(d)
        self.lm_head = w(d, c.vocab, std=d**-0.5)
        # Rotary tables for every position, built once in float64 then rounded.
        inv = c.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.arange(c.max_positions, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos = angles.cos().to(torch.float32).to(self.device)
        self.sin = angles.sin().to(torch.float32).to(self.device)

    # --- state -----------------------------------------------------------------------
    def empty_state(self) -> KVState:
        c = self.config
        empty = [torch.zeros(2, 0, c.kv_heads, c.head_dim, device=self.device) for _ in c.layers]
        return KVState(empty, [0] * len(c.layers), 0)

    def state_from_cached(self, cached: CachedKV) -> KVState:
        """A state from a cache hit; raises ValueError if the hit cannot serve as a
        prefix (wrong shapes, not page-aligned, too little SWA history)."""
        c = self.config
        n, s = cached.tokens, cached.starts.get(PoolName.SWA, 0)
        if not isinstance(n, int) or n < 0 or n % c.page_size or n > c.max_positions:
            raise ValueError(f"cached prefix of {n!r} tokens is not a whole number of pages")
        if n == 0:
            return self.empty_state()
        # The next token (position n, or n - 1 when recomputing the last logits)
        # needs SWA keys from n - window on.
        if not isinstance(s, int) or not 0 <= s <= max(0, n - c.window):
            raise ValueError(f"SWA history from {s!r} cannot serve a prefix of {n} tokens")
        if len(cached.layers) != len(self.kinds):
            raise ValueError(
                f"cached KV has {len(cached.layers)} layers, model has {len(self.kinds)}"
            )
        layers, starts = [], []
        for i, (t, kind) in enumerate(zip(cached.layers, self.kinds)):
            start = 0 if kind == LayerKind.FULL else s
            want = (2, n - start, c.kv_heads, c.head_dim)
            if (
                not isinstance(t, torch.Tensor)
                or tuple(t.shape) != want
                or t.dtype != torch.float32
            ):
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
                raise ValueError(f"cached layer {i} should be float32 {want}, got {got}")
            layers.append(t.to(self.device).contiguous())
            starts.append(start)
        return KVState(layers, starts, n)

    # --- public steps ----------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, tokens: Sequence[int], past: KVState | None = None
    ) -> tuple[torch.Tensor, KVState]:
        """K/V of every prompt token, computed from the end of `past` (a
        page-aligned prefix of `tokens`) in page chunks, and the logits after the
        last prompt token. `past` is not modified."""
        ps = self.config.page_size
        state = past if past is not None else self.empty_state()
        if state.length % ps or state.length > len(tokens) or not tokens:
            raise ValueError(
                f"past of {state.length} tokens is not a page-aligned prefix "
                f"of a {len(tokens)}-token prompt"
            )
        state = KVState(list(state.layers), list(state.starts), state.length)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        for c in range(state.length, len(tokens), ps):
            self._forward(ids[c : c + ps], state, at=c, commit=True, logits=False)
        last = len(tokens) - 1
        logits = self._forward(ids[last:], state, at=last, commit=False, logits=True)
        assert logits is not None  # asked for
        return logits[-1], state

    @torch.inference_mode()
    def decode_step(self, token: int, state: KVState) -> torch.Tensor:
        """Append `token` at position state.length; returns the logits after it."""
        ids = torch.tensor([token], dtype=torch.long, device=self.device)
        logits = self._forward(ids, state, at=state.length, commit=True, logits=True)
        assert logits is not None  # asked for
        return logits[-1]

    def generate(
        self, tokens: Sequence[int], max_tokens: int, past: KVState | None = None
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding without any cache object: the reference output."""
        logits, state = self.prefill(tokens, past)
        out: list[int] = []
        steps: list[torch.Tensor] = []
        for i in range(max_tokens):
            if i:
                logits = self.decode_step(out[-1], state)
            steps.append(logits)
            out.append(int(torch.argmax(logits)))
        return out, steps

    # --- the forward pass --------------------------------------------------------------
    def _forward(
        self, ids: torch.Tensor, state: KVState, at: int, commit: bool, logits: bool
    ) -> torch.Tensor | None:
        """Tokens `ids` at positions [at, at + len). Keys come from the state's
        positions before `at` plus these tokens. `commit` appends their K/V to the
        state (then `at` must be state.length). Without `logits`, the last
        layer stops once its K/V exist: nothing downstream would be used."""
        c = self.config
        n = ids.shape[0]
        pos = torch.arange(at, at + n, device=self.device)
        cos, sin = self.cos[at : at + n, None, :], self.sin[at : at + n, None, :]
        x = self.embed[ids]
        last = len(self.blocks) - 1
        for i, (blk, kind) in enumerate(zip(self.blocks, self.kinds)):
            h = _rms(x, blk["attn_norm"], c.eps)
            q = _rope((h @ blk["wq"]).view(n, c.n_heads, c.head_dim), cos, sin)
            k = _rope((h @ blk["wk"]).view(n, c.kv_heads, c.head_dim), cos, sin)
            v = (h @ blk["wv"]).view(n, c.kv_heads, c.head_dim)
            new = torch.stack([k, v])
            start = state.starts[i]
            lo = 0 if kind == LayerKind.FULL else max(0, at - c.window + 1)
            if lo < start:
                raise ValueError(
                    f"layer {i} needs keys from {lo}, the state holds them from {start}"
                )
            keys = torch.cat([state.layers[i][:, lo - start : at - start], new], dim=1)
            if commit:
                state.layers[i] = torch.cat([state.layers[i], new], dim=1)
            if i == last and not logits:
                break
            window = c.window if kind == LayerKind.SWA else 0
            kpos = torch.arange(lo, at + n, device=self.device)
            x = x + _attend(q, keys[0], keys[1], pos, kpos, window) @ blk["wo"]
            h = _rms(x, blk["mlp_norm"], c.eps)
            x = (
                x
                + (torch.nn.functional.silu(h @ blk["w_gate"]) * (h @ blk["w_up"])) @ blk["w_down"]
            )
        if commit:
            state.length = at + n
        if not logits:
            return None
        return _rms(x, self.final_norm, c.eps) @ self.lm_head


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qpos: torch.Tensor,
    kpos: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """q [n, Hq, D], k/v [m, Hkv, D] -> [n, Hq*D]; causal, and within `window` if > 0."""
    n, hq, d = q.shape
    rep = hq // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).permute(1, 2, 0)  # [Hq, D, m]
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, m, D]
    scores = (q.transpose(0, 1) @ k) * (d**-0.5)  # [Hq, n, m]
    masked = kpos[None, :] > qpos[:, None]
    if window:
        masked |= kpos[None, :] <= qpos[:, None] - window
    scores = scores.masked_fill(masked, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [Hq, n, D]
    return out.transpose(0, 1).reshape(n, hq * d)
