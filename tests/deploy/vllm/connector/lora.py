"""A seeded-random LoRA adapter for the tiny model (PEFT's files), written for tests that
need an adapter whose K/V differ from the base model's. No test here."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from kvfabric.deploy.vllm.serve.model import TinyModelSpec

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_adapter(folder: Path, spec: TinyModelSpec, seed: int, scale: float = 0.5) -> Path:
    """An adapter on every attention projection (so K and V change), in `folder`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, d = spec.hidden, spec.head_dim
    outs = {"q_proj": spec.heads * d, "k_proj": spec.kv_heads * d, "v_proj": spec.kv_heads * d}
    outs["o_proj"] = h
    ins = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": spec.heads * d}
    weights = {}
    for i in range(spec.layers):
        for t in TARGETS:
            p = f"base_model.model.model.layers.{i}.self_attn.{t}"
            weights[f"{p}.lora_A.weight"] = torch.randn(RANK, ins[t], generator=g) * ins[t] ** -0.5
            weights[f"{p}.lora_B.weight"] = torch.randn(outs[t], RANK, generator=g) * scale
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": RANK,
                "lora_alpha": RANK,
                "lora_dropout": 0.0,
                "target_modules": list(TARGETS),
                "bias": "none",
                "fan_in_fan_out": False,
                "modules_to_save": None,
                "use_rslora": False,
                "use_dora": False,
            }
        )
    )
    return folder
