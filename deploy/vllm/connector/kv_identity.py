"""A vLLM engine's KV identity: everything besides the layout's geometry that decides
a page's bytes, read from vLLM's own resolved config, never from folder names.

- model: the digest of the model's files' content (events/content_digest.py), so another
  fine-tune, a newer snapshot or a folder updated in place is another model, and the
  same files under two paths are one (the name is not in it);
- config: a digest of the Hugging Face config as vLLM resolved it (hf_overrides, rope
  scaling and whatever else the engine applied);
- dtype, kv_cache_dtype (fp8 formats differ; their scales come with the weights),
  quantization;
- device: a GPU's kernels round differently from the CPU's;
- kernel: on CPU, the instruction sets that choose how the attention kernel lays out a
  block (AMX, AVX-512), so a page written by one kernel is never read by another.

It becomes the layout's tag (`name=value` parts, so a mismatch names the part); the
tensor-parallel size is not in it, since a page holds every KV head whatever the
split. What varies per request (namespace, LoRA adapter, multimodal inputs) is in the
request's cache namespace instead (events/namespaces.py).
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from dataclasses import dataclass, fields
from typing import Any

import torch
from kvfabric.core.cache.layout import TAG_SEP
from kvfabric.deploy.vllm.events.content_digest import folder_digest, resolve_folder

DEVICE_KINDS = ("cpu", "cuda")
_UNSAFE = re.compile(r"[;=\s]")
# Fields of a resolved HF config that name where it was read from, not what it says.
_VOLATILE = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation")


class IdentityError(ValueError):
    """An engine whose KV identity cannot be established (say which setting fixes it)."""


@dataclass(frozen=True)
class KVIdentity:
    model: str
    config: str
    dtype: str
    kv_cache_dtype: str
    quantization: str
    device: str
    kernel: str

    def tag(self) -> str:
        return TAG_SEP.join(["vllm"] + [f"{f.name}={getattr(self, f.name)}" for f in fields(self)])

    @classmethod
    def of(cls, vllm_config: Any, model_digest: str = "") -> "KVIdentity":
        """The identity of the engine `vllm_config` describes. `model_digest`: the model's
        content as the deployer names it (skips reading its files)."""
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        device = vllm_config.device_config.device_type
        if device not in DEVICE_KINDS:
            raise IdentityError(f"engines on {device!r}: the fabric serves {DEVICE_KINDS}")
        digest = model_digest or folder_digest(resolve_folder(mc.model, mc.revision))
        return cls(
            model=_clean(digest),
            config=config_digest(mc.hf_config),
            dtype=_dtype_name(mc.dtype),
            kv_cache_dtype=_clean(str(cc.cache_dtype)),
            quantization=_clean(str(mc.quantization or "none")),
            device=device,
            kernel=cpu_kernel() if device == "cpu" else "",
        )


def config_digest(hf_config: Any) -> str:
    """A digest of what a resolved config says (nested configs included)."""
    as_dict = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    for key in _VOLATILE:
        as_dict.pop(key, None)
    text = json.dumps(as_dict, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8, person=b"kvf-config").hexdigest()


def cpu_kernel() -> str:
    """What selects the CPU attention kernel's block layout beyond dtype and block size."""
    feats = [platform.machine() or "unknown"]
    if torch.cpu._is_amx_tile_supported():
        feats.append("amx")
    if torch.cpu._is_avx512_supported():
        feats.append("avx512")
    return "+".join(feats)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _clean(value: str) -> str:
    """A tag part's value: no separator, no space, bounded (a long name keeps its end)."""
    return _UNSAFE.sub("_", value)[-200:]
