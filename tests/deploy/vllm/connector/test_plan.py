"""vLLM's KV cache config as a fabric plan, from vLLM's own config objects (a resolved
engine config is stood in for by its few fields the plan reads): every KV head in a
page whatever the tensor-parallel split, windowed layers with the hybrid allocator off
stored whole, all-SWA models, fp8 KV, and what cannot be stored refused with why."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvfabric.core.cache.layout import LayerKind, PoolName
from kvfabric.deploy.vllm.connector.plan import HeadShard, PlanError, plan_from_kv_cache_config  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

BLOCK, D = 32, 64


def names(*idx: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in idx]


def full(heads: int = 2, dtype=torch.float32, **kw) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=D, dtype=dtype, **kw)


def swa(heads: int = 2, dtype=torch.float32, window: int = 256) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=heads, head_size=D, dtype=dtype, sliding_window=window
    )


def engine(heads: int = 2, tp: int = 1, pp: int = 1, spec_decode=None) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: heads),
        speculative_config=spec_decode,
    )


def config(*groups: tuple[list[str], object]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(n, s) for n, s in groups],
    )


def test_a_hybrid_model_maps_groups_to_pools_in_layer_order():
    plan = plan_from_kv_cache_config(config((names(0, 2), swa()), (names(1, 3), full())), engine())
    assert plan.layout.layers == (LayerKind.SWA, LayerKind.FULL, LayerKind.SWA, LayerKind.FULL)
    assert plan.group_pools == (PoolName.SWA, PoolName.FULL)
    assert [(s.pool, s.index) for s in plan.layers] == [
        (PoolName.SWA, 0),
        (PoolName.FULL, 0),
        (PoolName.SWA, 1),
        (PoolName.FULL, 1),
    ]
    assert plan.layout.window == 256 and plan.ranks == 1 and plan.layout.tag == ""


@pytest.mark.parametrize("heads,tp", [(4, 2), (8, 4), (2, 2), (1, 2), (2, 4)])
def test_a_page_holds_every_head_whatever_the_split(heads, tp):
    per_rank = max(1, heads // tp)
    plan = plan_from_kv_cache_config(
        config((names(0, 1), full(per_rank))), engine(heads=heads, tp=tp)
    )
    assert plan.layout.kv_heads == heads and plan.ranks == tp
    shards = [plan.shard(r) for r in range(tp)]
    assert all(s.count == per_rank for s in shards)
    written = sorted(h for s in shards if s.writes for h in range(s.first, s.first + s.count))
    assert written == list(range(heads))  # every head written, once
    # Each rank holds the heads vLLM gives it: a replicated head is read by all its ranks.
    assert {h for s in shards for h in range(s.first, s.first + s.count)} == set(range(heads))
    # The same model unsplit has the same layout: its pages serve either engine.
    one = plan_from_kv_cache_config(config((names(0, 1), full(heads))), engine(heads=heads))
    assert one.layout == plan.layout


def test_head_shards():
    assert HeadShard.of(1, 2, 4) == HeadShard(2, 2, True)
    assert HeadShard.of(3, 4, 2) == HeadShard(1, 1, False)
    for bad in ((2, 2, 4), (0, 3, 4), (0, 3, 2)):
        with pytest.raises(PlanError):
            HeadShard.of(*bad)


def test_heads_per_rank_that_disagree_with_the_split_are_refused():
    with pytest.raises(PlanError, match="KV heads per rank"):
        plan_from_kv_cache_config(config((names(0), full(4))), engine(heads=4, tp=2))


@pytest.mark.parametrize(
    "what,eng",
    [
        ("pipeline parallelism", engine(pp=2)),
        (
            "speculative decoding",
            engine(
                spec_decode=SimpleNamespace(
                    method="eagle", use_eagle=lambda: True, uses_draft_model=lambda: False
                )
            ),
        ),
    ],
)
def test_splits_and_drafters_the_fabric_cannot_follow_are_refused(what, eng):
    with pytest.raises(PlanError, match=what):
        plan_from_kv_cache_config(config((names(0), full())), eng)


def test_ngram_speculation_keeps_no_kv_and_is_served():
    ngram = SimpleNamespace(method="ngram", use_eagle=lambda: False, uses_draft_model=lambda: False)
    assert plan_from_kv_cache_config(config((names(0), full())), engine(spec_decode=ngram))


def test_windowed_layers_with_the_hybrid_allocator_off_are_stored_whole():
    """vLLM then gives every layer a FullAttentionSpec (the window recorded) and keeps KV
    for every position: one FULL pool, no window in the layout."""
    plan = plan_from_kv_cache_config(
        config((names(0, 1, 2, 3), full(sliding_window=256))), engine()
    )
    assert plan.layout.layers == (LayerKind.FULL,) * 4
    assert plan.layout.window == 0 and plan.layout.pools == (PoolName.FULL,)


def test_an_all_swa_model_has_one_swa_pool():
    plan = plan_from_kv_cache_config(config((names(0, 1), swa(window=128))), engine())
    assert plan.layout.pools == (PoolName.SWA,) and plan.layout.window == 128


def test_fp8_kv_is_stored_as_bytes():
    plan = plan_from_kv_cache_config(config((names(0), full(dtype=torch.uint8))), engine())
    assert plan.layout.dtype == "uint8" and plan.layout.torch_dtype == torch.uint8
    mode = KVQuantMode.FP8_PER_TOKEN_HEAD
    with pytest.raises(PlanError, match="per token"):
        plan_from_kv_cache_config(
            config((names(0), full(dtype=torch.uint8, kv_quant_mode=mode))), engine()
        )


def test_what_the_fabric_cannot_store_is_refused_naming_it():
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=D, dtype=torch.float32)
    with pytest.raises(PlanError, match="MLAAttentionSpec"):
        plan_from_kv_cache_config(config((names(0), mla)), engine())
    with pytest.raises(PlanError, match="differ"):
        plan_from_kv_cache_config(
            config((names(0), full()), (names(1), swa(dtype=torch.bfloat16))), engine()
        )
    with pytest.raises(PlanError, match="V heads"):
        plan_from_kv_cache_config(config((names(0), full(head_size_v=32))), engine())
    with pytest.raises(PlanError, match="dtype"):
        plan_from_kv_cache_config(config((names(0), full(dtype=torch.int32))), engine())


def test_the_identity_tags_a_copy():
    plan = plan_from_kv_cache_config(config((names(0), full())), engine())
    tagged = plan.with_tag("vllm;model=abc")
    assert tagged.layout.tag == "vllm;model=abc" and plan.layout.tag == ""
    assert tagged.layout.fingerprint != plan.layout.fingerprint
