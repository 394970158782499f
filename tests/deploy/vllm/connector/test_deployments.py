"""The FabricConnector on the vLLM deployments users run, for real: vLLM's CPU build, tiny
seeded-random models written here, one Ray cluster of two nodes, engines in this
process (vLLM's own prefix cache cleared before each check, so only the fabric can hit).

- tensor parallelism: a TP=2 engine (two worker processes, one core each) with host and
  remote hits; its pages load into a TP=1 engine of the same model and back;
- each part of the KV identity varied alone (the model's content under the same folder
  name, dtype, kv_cache_dtype) and a LoRA adapter: nothing crosses, and every output
  equals the uncached one (a fresh cache_salt, which no cache can match);
- fp8 KV, the hybrid allocator off, an all-SWA model, and two models on one node: hits,
  and outputs equal uncached;
- a prompt whose length is a multiple of the page size hits when asked again.

One engine (model A, fp32, TP=1, LoRA on) lives for the module; each other deployment
starts beside it in its own test and stops at its end, with the fabric it started.
"""

from __future__ import annotations

import glob
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import pytest

vllm = pytest.importorskip("vllm")

import ray  # noqa: E402
import torch  # noqa: E402
from kvfabric.actors.client import FabricClient
from kvfabric.actors.directory import node_actor_name  # noqa: E402
from kvfabric.actors.launch import (
    running,  # noqa: E402
    stop,
)
from kvfabric.actors.served import fabrics_of  # noqa: E402
from kvfabric.core.cache.layout import PoolName
from kvfabric.deploy.vllm.serve.model import TinyModelSpec, ensure_tiny_model  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from tests.deploy.vllm.connector.connector_engine import (  # noqa: E402
    BLOCK,
    CALL_TIMEOUT_S,
    MAX_TOKENS,
    PROMPT_CHARS,
    Engine,
    engine_args,
)
from tests.deploy.vllm.connector.lora import write_adapter  # noqa: E402

SPEC = TinyModelSpec()
FLOOR = (PROMPT_CHARS - 1) // BLOCK * BLOCK - BLOCK  # tokens a whole-prompt hit loads at least


@dataclass
class Site:
    address: str
    here: str  # the head node's actor name: engines run in this process, on that node
    models: Path


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[Site]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1)  # the remote node
    ray.init(address=cluster.address, namespace="kvf-deployments-test")
    cluster.wait_for_nodes()
    try:
        here = node_actor_name(ray.get_runtime_context().get_node_id())
        yield Site(cluster.address, here, tmp_path_factory.mktemp("models"))
    finally:
        from kvfabric.deploy.harness.cluster import down

        down()
        ray.shutdown()
        cluster.shutdown()


@contextmanager
def deployed(site: Site, served: str, model: Path, **llm_args) -> Iterator[Engine]:
    """An engine serving `model` as `served` with the FabricConnector; its fabric (the one
    of its KV identity) is stopped after, unless an engine still alive shares it."""
    from vllm import LLM

    keep_fabric = llm_args.pop("keep_fabric", False)
    started = time.monotonic()
    llm = LLM(
        model=str(model),
        served_model_name=served,
        **{**engine_args(site.here, site.address), **llm_args},
    )
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    try:
        (namespace,) = fabrics_of(served)
        fab = running(namespace)
        assert fab is not None
        (there,) = set(fab.nodes) - {site.here}
        layout = FabricClient.connect(CALL_TIMEOUT_S, namespace).layout
        print(f"\n{served}: engine up in {time.monotonic() - started:.1f} s")
        yield Engine(llm, fab, site.here, there, "", layout)
    finally:
        llm.llm_engine.engine_core.shutdown()
        if not keep_fabric and (found := fabrics_of(served)):
            for namespace in found:
                if (fab := running(namespace)) is not None and not shared(namespace):
                    stop(fab)
        for f in glob.glob(f"/dev/shm/kvf-vllm-{engine_id}[-.]*"):
            os.unlink(f)


SHARED: set[str] = set()  # fabrics of the module's engine


def shared(namespace: str) -> bool:
    return namespace in SHARED


def hit(engine: Engine, prompt: str, **kw) -> tuple[list[int], int]:
    """The output of `prompt` with the engine's own cache cleared, and the tokens the
    fabric loaded for it (the request's cached tokens: vLLM's own cache holds none).
    Not vLLM's metrics: engines in one process share one registry."""
    engine.clear_own_cache()
    return run(engine, prompt, **kw)


def run(engine: Engine, prompt: str, salt: str | None = None, lora=None) -> tuple[list[int], int]:
    from vllm import SamplingParams

    item = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
    out = engine.llm.generate(
        [item],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
        lora_request=lora,
    )[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def generate(engine: Engine, prompt: str, **kw) -> list[int]:
    return run(engine, prompt, **kw)[0]


def uncached(engine: Engine, prompt: str, lora=None) -> list[int]:
    out, cached = run(engine, prompt, salt=f"ref-{uuid.uuid4().hex}", lora=lora)
    assert cached == 0
    return out


def fetches(engine: Engine) -> int:
    """Remote prefixes the engine's node committed (fetched from the other node)."""
    stats = ray.get(engine.node.stats.remote(), timeout=CALL_TIMEOUT_S)
    return stats["fetches"].get("committed", 0)


def model_a() -> Path:
    return ensure_tiny_model(SPEC)


@pytest.fixture(scope="module")
def base(site) -> Iterator[Engine]:
    """Model A, fp32, TP=1, LoRA on: alive for the module."""
    with deployed(
        site,
        "model-a",
        model_a(),
        enable_lora=True,
        max_lora_rank=8,
        max_loras=1,
        keep_fabric=True,
    ) as engine:
        SHARED.add(engine.namespace)
        yield engine


def adapter(site: Site, name: str, seed: int):
    from vllm.lora.request import LoRARequest

    folder = write_adapter(site.models / f"lora-{name}-{seed}", SPEC, seed)
    return LoRARequest(name, seed + 1, str(folder))


def test_lora_adapter_kv_never_serves_the_base_model_and_back(site, base):
    """A base request and an adapter's request of the same prompt: neither loads the
    other's pages; each hits its own, and every output equals its uncached one."""
    lora = adapter(site, "a1", 1)
    prompt = base.text()
    want_base, want_lora = uncached(base, prompt), uncached(base, prompt, lora)
    assert want_base != want_lora  # the adapter changes K/V and the output
    assert generate(base, prompt) == want_base  # computed, saved under the base's namespace
    out, loaded = hit(base, prompt, lora=lora)
    assert (out, loaded) == (want_lora, 0)  # nothing crossed; now saved under the adapter's
    out, loaded = hit(base, prompt, lora=lora)
    assert out == want_lora and loaded >= FLOOR
    out, loaded = hit(base, prompt)
    assert out == want_base and loaded >= FLOOR


def test_a_prompt_of_whole_pages_hits_when_asked_again(base):
    prompt = base.text(32 * BLOCK)  # one token per byte: exactly 32 pages
    want = uncached(base, prompt)
    assert generate(base, prompt) == want
    out, loaded = hit(base, prompt)
    assert out == want and loaded == 31 * BLOCK  # vLLM computes the last token itself


def test_tensor_parallel_engine_hits_host_and_remote_and_shares_pages_with_tp1(site, base):
    """A TP=2 engine of model A (two workers, one core each) is the same KV identity as
    the TP=1 one: it loads the pages TP=1 computed, TP=1 loads the pages it computed;
    it hits the node's host tier and a prefix only the other node holds; every output
    equals uncached."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        with deployed(
            site, "model-a-tp2", model_a(), tensor_parallel_size=2, keep_fabric=True
        ) as tp2:
            assert tp2.namespace == base.namespace  # one identity: one fabric
            p1 = base.text()
            assert generate(base, p1) == uncached(base, p1)  # TP=1 computes it
            want = uncached(tp2, p1)
            out, loaded = hit(tp2, p1)
            assert out == want and loaded >= FLOOR  # ... and TP=2 loads it
            p2 = tp2.text()
            assert generate(tp2, p2) == uncached(tp2, p2)  # TP=2 computes it
            out, loaded = hit(base, p2)
            assert out == uncached(base, p2) and loaded >= FLOOR  # ... and TP=1 loads it
            # The node's host tier: other prompts push p2's pages out of its device tier.
            host_before = tp2.node_host_hits()
            tp2.evict()
            out, loaded = hit(tp2, p2)
            assert out == uncached(tp2, p2) and loaded >= FLOOR
            assert tp2.node_host_hits() > host_before
            # A prefix only the other node holds: fetched over NIXL, then loaded.
            p3 = tp2.text()
            want = uncached(tp2, p3)
            tp2.move_to_peer(p3)
            fetched = fetches(tp2)
            out, loaded = hit(tp2, p3)
            assert out == want and loaded >= FLOOR and fetches(tp2) == fetched + 1
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def assert_nothing_crosses(base: Engine, other: Engine, field: str, page_dtype: bool) -> None:
    """`other` differs from the module's engine in `field` of its KV identity alone (and
    so, with `page_dtype`, in its pages' element type): a prompt the module's engine
    saved is not loaded by it, and it hits its own pages."""
    named = {d.split(":")[0] for d in base.layout.differences(other.layout)}
    assert named == {f"tag {field}"} | ({"dtype"} if page_dtype else set()), named
    assert other.namespace != base.namespace
    prompt = base.text()
    assert generate(base, prompt) == uncached(base, prompt)
    out, loaded = hit(other, prompt)
    assert (out, loaded) == (uncached(other, prompt), 0)
    assert_hits(other)


def assert_hits(engine: Engine) -> None:
    prompt = engine.text()
    want = uncached(engine, prompt)
    assert generate(engine, prompt) == want
    out, loaded = hit(engine, prompt)
    assert out == want and loaded >= FLOOR


def test_dtype_varied_alone(site, base):
    with deployed(site, "model-a-bf16", model_a(), dtype="bfloat16") as bf16:
        assert_nothing_crosses(base, bf16, "dtype", page_dtype=True)


@pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX",
)
def test_fp8_kv_cache_varied_alone(site, base):
    with deployed(site, "model-a-fp8", model_a(), kv_cache_dtype="fp8") as fp8:
        assert fp8.layout.dtype == "uint8"
        assert_nothing_crosses(base, fp8, "kv_cache_dtype", page_dtype=True)


def test_another_model_under_the_same_folder_name_and_two_models_on_one_node(site, base):
    """Model B: other weights, copied to a folder of the same name as a copy of model A
    (as a newer snapshot would be). It never loads A's pages; A and B, on one node at
    once, each hit their own."""
    a = shutil.copytree(model_a(), site.models / "2026-11-30" / "chat-model")
    b = shutil.copytree(
        ensure_tiny_model(replace(SPEC, seed=1)), site.models / "2026-12-05" / "chat-model"
    )
    with deployed(site, "chat-model-a", Path(a), keep_fabric=True) as copy_of_a:
        assert copy_of_a.namespace == base.namespace  # the same bytes elsewhere: one identity
    with deployed(site, "chat-model-b", Path(b)) as other:
        assert_nothing_crosses(base, other, "model", page_dtype=False)
        assert_hits(base)  # both models' fabrics on this node, both serving
        assert_hits(other)


def test_hybrid_allocator_off(site, base):
    """Windowed layers then keep every position's KV in vLLM: stored whole, full pool."""
    with deployed(
        site, "model-a-no-hma", model_a(), disable_hybrid_kv_cache_manager=True
    ) as engine:
        assert engine.layout.pools == (PoolName.FULL,) and engine.layout.window == 0
        assert_hits(engine)


def test_all_swa_model(site, base):
    spec = replace(SPEC, full_every=0)
    with deployed(site, "model-swa", ensure_tiny_model(spec)) as engine:
        assert engine.layout.window == spec.window and engine.layout.pools == (PoolName.SWA,)
        assert_hits(engine)
