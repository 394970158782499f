"""What decides a page's bytes besides its tokens: the engine's KV identity (its model's
content, resolved config, dtypes, quantization, device and kernel) and a request's
namespace (tenant, LoRA adapter, multimodal inputs; prompt embeddings never cached).
Each field varied alone changes the identity; the same content under another path does
not. A cache keyed by these never lets a page cross two identities (the property test at
the end, on a real NodeCache)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.core.cache.layout import KVLayout
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.deploy.serving.cache_namespace import INPUTS, cache_namespace
from kvfabric.deploy.vllm.connector.kv_identity import IdentityError, KVIdentity, config_digest
from kvfabric.deploy.vllm.events.content_digest import (
    DigestError,
    DigestTable,
    folder_digest,
    resolve_folder,
)
from kvfabric.deploy.vllm.events.namespaces import RequestNamespaces

from tests.examples import examples
from tests.kvgen import prefix_kv


def write_model(folder: Path, weights: bytes, config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"hidden_size": 8}))
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture
def table(tmp_path) -> DigestTable:
    return DigestTable(tmp_path / "digests.json")


def test_the_digest_follows_content_not_paths(tmp_path, table):
    a = write_model(tmp_path / "2026-11-30" / "chat-model", b"weights-a" * 100)
    b = write_model(tmp_path / "2026-12-05" / "chat-model", b"weights-b" * 100)  # same name
    c = write_model(tmp_path / "elsewhere" / "renamed", b"weights-a" * 100)  # same bytes
    assert folder_digest(a, table) != folder_digest(b, table)
    assert folder_digest(a, table) == folder_digest(c, table)
    # The tokenizer and docs change token ids, which page keys cover: not the digest.
    (c / "tokenizer.json").write_text('{"changed": 1}')
    (c / "README.md").write_text("notes")
    assert folder_digest(a, table) == folder_digest(c, table)
    # Another config (rope, say) or another file is another model.
    (c / "config.json").write_text(json.dumps({"hidden_size": 8, "rope_theta": 1.0}))
    assert folder_digest(a, table) != folder_digest(c, table)


def test_a_folder_updated_in_place_is_read_again(tmp_path, table):
    m = write_model(tmp_path / "m", b"x" * 1000)
    before = folder_digest(m, table)
    assert folder_digest(m, table) == before  # from the table
    st = (m / "model.safetensors").stat()
    (m / "model.safetensors").write_bytes(b"y" * 1000)  # same size
    os.utime(m / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert folder_digest(m, table) != before


def test_the_table_saves_reads_and_a_bad_one_is_ignored(tmp_path):
    m = write_model(tmp_path / "m", b"w" * 64)
    path = tmp_path / "digests.json"
    first = folder_digest(m, DigestTable(path))
    kept = json.loads(path.read_text())
    assert len(kept) == 2  # config.json and the weights
    # A table entry stands for the file's bytes: the next start reads nothing.
    forged = {k: "b2:" + "0" * 32 for k in kept}
    path.write_text(json.dumps(forged))
    assert folder_digest(m, DigestTable(path)) != first  # it was used, not the file
    for bad in ("not json", json.dumps([1, 2]), json.dumps({"k": 3})):
        path.write_text(bad)
        assert folder_digest(m, DigestTable(path)) == first  # ignored: files read again


def test_hub_snapshots_are_named_by_their_blobs(tmp_path, table):
    """A Hugging Face cache snapshot links each file to a blob named by its content hash:
    that name is the digest (nothing is read)."""
    repo = tmp_path / "models--org--m"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for name, blob in (("config.json", "1" * 40), ("model.safetensors", "a" * 64)):
        (blobs / blob).write_bytes(b"whatever")
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / blob)
    other = tmp_path / "models--org--n" / "snapshots" / "def456"
    shutil.copytree(repo, tmp_path / "models--org--n", symlinks=True)
    (tmp_path / "models--org--n" / "snapshots" / "abc123").rename(other)
    assert folder_digest(snap, table) == folder_digest(other, table)
    (other / "model.safetensors").unlink()
    (blobs / ("b" * 64)).write_bytes(b"whatever")
    (other / "model.safetensors").symlink_to(Path("..") / ".." / "blobs" / ("b" * 64))
    assert folder_digest(snap, table) != folder_digest(other, table)


def test_a_model_that_cannot_be_found_names_the_setting_that_helps(tmp_path):
    with pytest.raises(DigestError, match="model_digest"):
        resolve_folder("no-such-org/no-such-model-kvf")
    with pytest.raises(DigestError):
        folder_digest(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DigestError, match="no files"):
        folder_digest(empty)


# --- the engine's identity -------------------------------------------------------------------


class HFConfig(dict):
    def to_dict(self) -> dict:
        return dict(self)


def engine(model: str, **over) -> SimpleNamespace:
    mc = dict(
        model=model,
        revision=None,
        dtype=torch.float32,
        quantization=None,
        hf_config=HFConfig(_name_or_path=model, hidden_size=8, rope_theta=10000.0),
    )
    cc = dict(cache_dtype="auto")
    device = over.pop("device", "cpu")
    for k, v in over.items():
        (cc if k == "cache_dtype" else mc)[k] = v
    return SimpleNamespace(
        model_config=SimpleNamespace(**mc),
        cache_config=SimpleNamespace(**cc),
        device_config=SimpleNamespace(device_type=device),
    )


@pytest.fixture
def model(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("KVF_DIGEST_CACHE", str(tmp_path / "digests.json"))
    DigestTable._default = None
    return str(write_model(tmp_path / "m", b"weights" * 64))


@pytest.mark.parametrize(
    "field,change",
    [
        ("dtype", {"dtype": torch.bfloat16}),
        ("kv_cache_dtype", {"cache_dtype": "fp8_e4m3"}),
        ("quantization", {"quantization": "fp8"}),
        ("config", {"hf_config": HFConfig(hidden_size=8, rope_theta=500000.0)}),
        ("device", {"device": "cuda"}),
    ],
)
def test_each_field_varied_alone_changes_the_identity_and_is_named(model, field, change):
    base = KVIdentity.of(engine(model))
    other = KVIdentity.of(engine(model, **change))
    assert [f for f in vars(base) if getattr(base, f) != getattr(other, f)][0] == field
    lay = KVLayout(layers=("full",), kv_heads=1, head_dim=8, page_size=4)
    a = KVLayout(**{**vars(lay), "tag": base.tag()})
    b = KVLayout(**{**vars(lay), "tag": other.tag()})
    assert a.fingerprint != b.fingerprint
    named = {d.split(":")[0] for d in a.differences(b)}
    assert f"tag {field}" in named


def test_the_model_is_its_content_and_a_named_digest_skips_reading(model, tmp_path):
    same_bytes = write_model(tmp_path / "copy" / "other-name", b"weights" * 64)
    assert KVIdentity.of(engine(model)) == KVIdentity.of(engine(str(same_bytes)))
    retrained = write_model(tmp_path / "v2" / "m", b"WEIGHTS" * 64)
    assert KVIdentity.of(engine(model)).model != KVIdentity.of(engine(str(retrained))).model
    named = KVIdentity.of(engine("/nowhere/at/all"), model_digest="registry;v=7")
    assert named.model == "registry_v_7"  # no separator gets into the tag
    with pytest.raises(IdentityError, match="xpu"):
        KVIdentity.of(engine(model, device="xpu"))


def test_where_a_config_was_read_from_is_not_what_it_says():
    a = HFConfig(_name_or_path="/a", transformers_version="5.1", hidden_size=8)
    b = HFConfig(_name_or_path="/b", transformers_version="5.2", hidden_size=8)
    assert config_digest(a) == config_digest(b)
    assert config_digest(a) != config_digest(HFConfig(hidden_size=16))


# --- a request's namespace -------------------------------------------------------------------


def request(salt=None, lora=None, mm=(), embeds=None, rid="r") -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        cache_salt=salt,
        lora_request=lora,
        mm_features=[
            SimpleNamespace(identifier=h, mm_position=SimpleNamespace(offset=o, length=n))
            for h, o, n in mm
        ],
        prompt_embeds=embeds,
    )


def adapter(folder: Path, name: str = "a1") -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_path=str(folder))


def test_each_input_varied_alone_gives_another_namespace(tmp_path):
    names = RequestNamespaces(DigestTable(tmp_path / "t.json"))
    a1 = write_model(tmp_path / "a1", b"lora-1")
    a2 = write_model(tmp_path / "a2", b"lora-2")
    seen = {
        names.of(request()),
        names.of(request(salt="t1")),
        names.of(request(lora=adapter(a1))),
        names.of(request(lora=adapter(a2))),  # same name, other weights
        names.of(request(lora=adapter(a1, "other-name"))),
        names.of(request(mm=[("img-1", 4, 16)])),
        names.of(request(mm=[("img-2", 4, 16)])),  # same placeholder tokens, other image
        names.of(request(mm=[("img-1", 36, 16)])),
        names.of(request(salt="t1", lora=adapter(a1))),
    }
    assert len(seen) == 9
    assert names.of(request(salt="t1")) == cache_namespace("t1") == "salt/t1"
    assert names.of(request(embeds=torch.zeros(3, 8))) is None  # never cached
    # The feed names an adapter's blocks as the connector does, by its name.
    assert names.adapter_named("a1") == names.adapter(adapter(a1))


def test_an_adapter_that_cannot_be_read_leaves_its_requests_uncached(tmp_path):
    names = RequestNamespaces(DigestTable(tmp_path / "t.json"))
    assert names.of(request(lora=adapter(tmp_path / "missing"))) is None
    assert names.adapter_named("a1") is None


@settings(max_examples=examples(300), deadline=None)
@given(
    salt=st.one_of(st.none(), st.text(max_size=12)),
    lora=st.one_of(st.none(), st.text(max_size=8)),
    mm=st.lists(st.tuples(st.text(max_size=4), st.integers(0, 99), st.integers(1, 9)), max_size=2),
    other=st.tuples(
        st.one_of(st.none(), st.text(max_size=12)),
        st.one_of(st.none(), st.text(max_size=8)),
        st.lists(st.tuples(st.text(max_size=4), st.integers(0, 99), st.integers(1, 9)), max_size=2),
    ),
)
def test_no_page_crosses_two_request_identities(salt, lora, mm, other):
    """A put under one request's identity is found under another's only if they are the
    same identity (an empty salt is none, as vLLM has it)."""
    one, two = (salt, lora, tuple(mm)), (other[0], other[1], tuple(other[2]))
    same = (one[0] or None, one[1], one[2]) == (two[0] or None, two[1], two[2])
    ns1, ns2 = cache_namespace(*one), cache_namespace(*two)
    assert (ns1 == ns2) == same
    assert ns1.startswith(INPUTS) == (lora is not None or bool(mm))  # no salt spells one
    cache = NodeCache(LAYOUT, {p: PoolCapacity(8, 0) for p in LAYOUT.pools}, device="cpu")
    tokens = list(range(9))
    cache.put(tokens, prefix_kv(LAYOUT, tokens), ns1)
    assert (cache.match(tokens, ns2).usable_pages > 0) == same


LAYOUT = KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=2, page_size=4, window=8)
