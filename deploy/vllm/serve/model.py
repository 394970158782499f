"""A small full+SWA Llama written at first use: config, seeded random weights, tokenizer.

There is no model hub here, and vLLM's `load_format="dummy"` weights repeat one token, so
output checks need real (random but seeded) weights. The model is sized so that prefill
dominates time to first token and an engine starts fast: 4 layers, hidden 256, fp32,
sliding-window layers alternating with full-attention ones.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

MODEL_CACHE_ENV = "KVF_MODEL_CACHE"
# Bump when the files written change, so an old folder is not reused.
FORMAT = 2  # 2: a chat template


@dataclass(frozen=True)
class TinyModelSpec:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    window: int = 256  # sliding window in tokens
    max_positions: int = 4096
    seed: int = 0
    full_every: int = 2  # every n-th layer is full attention, the others windowed; 0: none

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_types(self) -> list[str]:
        # SWA first, full attention every `full_every`-th layer (as Gemma-style hybrids
        # do); with 0, every layer windowed (as Mistral's first models).
        n = self.full_every
        return [
            "full_attention" if n and i % n == n - 1 else "sliding_attention"
            for i in range(self.layers)
        ]

    @property
    def name(self) -> str:
        # Every field and the format version name the folder: a changed spec is a new model.
        digest = hashlib.blake2b(
            json.dumps([asdict(self), FORMAT]).encode(), digest_size=4
        ).hexdigest()
        return (
            f"kvf-tiny-llama-swa-l{self.layers}-h{self.hidden}-w{self.window}-s{self.seed}-{digest}"
        )


# The demo's model: bigger, so that prefill dominates time to first token on a CPU core
# (about 25M parameters: a 1,500-token prefill takes about a second, loading its KV from
# the node's pools a few tens of ms), yet it starts in seconds.
DEMO_SPEC = TinyModelSpec(layers=8, hidden=512, heads=8, kv_heads=2, intermediate=1536, window=512)


def model_cache_dir() -> Path:
    return Path(
        os.environ.get(MODEL_CACHE_ENV) or Path.home() / ".cache" / "ray-kv-fabric" / "models"
    )


def ensure_tiny_model(
    spec: TinyModelSpec = TinyModelSpec(), root: Path | None = None, say=print
) -> Path:
    """The model's folder, written first if missing (said through `say`)."""
    folder = (root or model_cache_dir()) / spec.name
    if (folder / "done").exists():
        return folder
    say(
        f"writing a small full+SWA model (seeded random weights) to {folder} "
        f"(first use; {MODEL_CACHE_ENV} overrides the folder)"
    )
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(tmp)
    _write_config(tmp, spec, vocab)
    _write_weights(tmp, spec, vocab)
    (tmp / "spec.json").write_text(json.dumps(asdict(spec)))
    (tmp / "done").write_text("ok\n")
    try:
        tmp.rename(folder)
    except OSError:  # another process wrote it first: theirs is as good
        if not (folder / "done").exists():
            raise
    return folder


# Each message as `<|role|>content` on its own line, then the assistant's turn: so that
# /v1/chat/completions serves the bundled model as /v1/completions does.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _write_tokenizer(folder: Path) -> int:
    """A byte-level tokenizer (one token per byte, no merges): any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "model_max_length": 1 << 20,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    )
    return len(vocab)


def _write_config(folder: Path, spec: TinyModelSpec, vocab: int) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "layer_types": spec.layer_types,
        "sliding_window": spec.window,
        "max_position_embeddings": spec.max_positions,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    )


def _write_weights(folder: Path, spec: TinyModelSpec, vocab: int) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(spec.seed)
    h, d, kv, inter = spec.hidden, spec.head_dim, spec.kv_heads, spec.intermediate

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    # Scales keep activations O(1) through the layers, so the logits are spread out
    # and greedy choices are not near-ties (which would make output checks flaky).
    w = {
        "model.embed_tokens.weight": rand(vocab, h, scale=1.0),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": rand(vocab, h, scale=h**-0.5),
    }
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = rand(spec.heads * d, h, scale=h**-0.5)
        w[p + "self_attn.k_proj.weight"] = rand(kv * d, h, scale=h**-0.5)
        w[p + "self_attn.v_proj.weight"] = rand(kv * d, h, scale=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = rand(h, spec.heads * d, scale=(spec.heads * d) ** -0.5)
        w[p + "mlp.gate_proj.weight"] = rand(inter, h, scale=h**-0.5)
        w[p + "mlp.up_proj.weight"] = rand(inter, h, scale=h**-0.5)
        w[p + "mlp.down_proj.weight"] = rand(h, inter, scale=inter**-0.5)
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
