"""The generated model (deploy/vllm/serve/model.py): written once, said on the console, the
same bytes for the same seed, in the folder KVF_MODEL_CACHE names. (That vLLM loads it
and decodes greedily the same way twice: tests/deploy/vllm/connector/test_vllm_connector.py.)"""

from __future__ import annotations

import json

import pytest
from kvfabric.deploy.vllm.serve.model import TinyModelSpec, ensure_tiny_model


def test_written_once_and_said(tmp_path, monkeypatch):
    monkeypatch.setenv("KVF_MODEL_CACHE", str(tmp_path))
    said: list[str] = []
    spec = TinyModelSpec(layers=2, hidden=64, heads=2, kv_heads=1, intermediate=64)
    path = ensure_tiny_model(spec, say=said.append)
    assert path.parent == tmp_path and len(said) == 1 and str(path) in said[0]
    assert ensure_tiny_model(spec, say=said.append) == path and len(said) == 1
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["sliding_window"] == spec.window
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).stat().st_size > 0


def test_same_seed_same_weights_other_seed_other(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    spec = TinyModelSpec(layers=2, hidden=64, heads=2, kv_heads=1, intermediate=64)
    a = safetensors.load_file(
        ensure_tiny_model(spec, root=tmp_path / "a", say=lambda _: None) / "model.safetensors"
    )
    b = safetensors.load_file(
        ensure_tiny_model(spec, root=tmp_path / "b", say=lambda _: None) / "model.safetensors"
    )
    from dataclasses import replace

    c = safetensors.load_file(
        ensure_tiny_model(replace(spec, seed=1), root=tmp_path / "c", say=lambda _: None)
        / "model.safetensors"
    )
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert any(not (a[k] == c[k]).all() for k in a if "norm" not in k)


def test_tokenizer_encodes_any_text_one_token_per_byte(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    spec = TinyModelSpec(layers=2, hidden=64, heads=2, kv_heads=1, intermediate=64)
    tok = tokenizers.Tokenizer.from_file(
        str(ensure_tiny_model(spec, root=tmp_path, say=lambda _: None) / "tokenizer.json")
    )
    text = "héllo, wörld ✓ 123"
    ids = tok.encode(text).ids
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text


def test_its_chat_template_renders_each_message_then_the_assistant_s_turn(tmp_path):
    transformers = pytest.importorskip("transformers")
    spec = TinyModelSpec(layers=2, hidden=64, heads=2, kv_heads=1, intermediate=64)
    folder = ensure_tiny_model(spec, root=tmp_path, say=lambda _: None)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi ✓"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>be brief\n<|user|>hi ✓\n<|assistant|>"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.decode(ids) == text
