"""K and V inside vLLM's per-layer KV tensors, for every backend format and physical order.

Each format's view must name the K and V that the backend's own kernels read (the split
is written here as vLLM's backends write it), for any stride order vLLM's KVCacheLayout
can give. And a page saved by an engine of one format and loaded by an engine of the
other holds the same K and V: the differential check of the two conversions. The CUDA
case runs where a GPU is (benchmarks/gpu_check.sh); here it is skipped."""

from __future__ import annotations

import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples

pytest.importorskip("vllm")

from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.deploy.vllm.connector.block_format import BlockFormat, BlockFormatError  # noqa: E402
from kvfabric.deploy.vllm.connector.jobs import CopyJob, FabricMeta, FabricSettings, PoolMove  # noqa: E402
from kvfabric.deploy.vllm.connector.plan import EnginePlan, LayerSlot  # noqa: E402
from kvfabric.deploy.vllm.connector.worker_side import WorkerSide  # noqa: E402
from kvfabric.transport.staging import StagingSpec  # noqa: E402

# Physical orders of a layer's logical [B, H, N, C] (vLLM's KVCacheLayout without L).
ORDERS = [(0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3)]
ROWS_ORDERS = [(0, 1, 2, 3), (1, 0, 2, 3)]  # CPU_ATTN's slab stays contiguous


def layer_tensor(
    blocks: int, heads: int, rows: int, content: int, order, gen, device="cpu"
) -> torch.Tensor:
    """A logical [blocks, heads, rows, content] tensor stored in physical `order`."""
    logical = (blocks, heads, rows, content)
    physical = torch.randn([logical[i] for i in order], generator=gen).to(device)
    return physical.permute(*[order.index(i) for i in range(4)])


def backend_k_v(
    t: torch.Tensor, fmt: BlockFormat, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [blocks, heads, rows, head_dim], split the way the backends split them."""
    if fmt is BlockFormat.KV_ROWS:  # cpu_attn: view (B, H, 2N, D), chunk on dim 2
        b, h, n, _ = t.shape
        k, v = t.view(b, h, 2 * n, head_dim).chunk(2, dim=2)
        return k, v
    k, v = t.transpose(1, 2).split(head_dim, dim=-1)  # flash_attn: (B, N, H, D) each
    return k.transpose(1, 2), v.transpose(1, 2)


@settings(max_examples=examples(60), deadline=None)
@given(
    fmt=st.sampled_from(list(BlockFormat)),
    data=st.data(),
    blocks=st.integers(1, 5),
    heads=st.integers(1, 3),
    rows=st.integers(1, 4),
    head_dim=st.integers(1, 4),
)
def test_the_view_names_the_k_and_v_the_backend_reads(fmt, data, blocks, heads, rows, head_dim):
    orders = ROWS_ORDERS if fmt is BlockFormat.KV_ROWS else ORDERS
    order = data.draw(st.sampled_from(orders))
    t = layer_tensor(
        blocks, heads, rows, 2 * head_dim, order, torch.Generator().manual_seed(blocks)
    )
    view = fmt.view(t, heads, rows, head_dim)
    k, v = backend_k_v(t, fmt, head_dim)
    assert torch.equal(view[:, :, 0], k) and torch.equal(view[:, :, 1], v)
    view[:, :, 1].fill_(7.0)  # a view: writes land where the backend reads
    assert bool((backend_k_v(t, fmt, head_dim)[1] == 7.0).all())


def test_formats_of_backends():
    assert BlockFormat.of_backends(["CPU_ATTN"]) is BlockFormat.KV_ROWS
    assert BlockFormat.of_backends(["FLASH_ATTN", "FLASHINFER"]) is BlockFormat.KV_CHANNELS
    with pytest.raises(BlockFormatError, match="MLA"):
        BlockFormat.of_backends(["FLASHMLA"])
    with pytest.raises(BlockFormatError, match="one KV format"):
        BlockFormat.of_backends(["CPU_ATTN", "FLASH_ATTN"])
    with pytest.raises(BlockFormatError):
        BlockFormat.of_backends([])


@pytest.mark.parametrize("fmt", list(BlockFormat))
def test_tensors_it_cannot_convert_are_refused(fmt):
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(RuntimeError, match="not"):
        fmt.view(torch.zeros(4, 2, 4, 15), 2, 4, 8)  # content dim not 2 * head_dim
    with pytest.raises(RuntimeError, match="innermost"):
        fmt.view(torch.zeros(4, 2, 16, 4).transpose(2, 3), 2, 4, 8)
    slab_split = layer_tensor(4, 2, 4, 16, (0, 2, 1, 3), gen)  # rows of a slab apart
    if fmt is BlockFormat.KV_ROWS:
        with pytest.raises(RuntimeError, match="slab"):
            fmt.view(slab_split, 2, 4, 8)
    else:
        assert fmt.view(slab_split, 2, 4, 8).shape == (4, 2, 2, 4, 8)


# --- a page saved by one format, loaded by the other ----------------------------------------

PS, H, D, NB = 4, 2, 8, 16
LAYOUT = KVLayout(
    layers=("full", "swa"), kv_heads=H, head_dim=D, page_size=PS, window=8, tag="vllm:test"
)
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PLAN = EnginePlan(
    LAYOUT,
    (LayerSlot(NAMES[0], 0, PoolName.FULL, 0), LayerSlot(NAMES[1], 1, PoolName.SWA, 0)),
    (PoolName.FULL, PoolName.SWA),
)


def copy_job(blocks: list[int], slots: list[int]) -> CopyJob:
    return CopyJob(
        "r",
        [PoolMove(PoolName.FULL, slots, {0: blocks}), PoolMove(PoolName.SWA, slots, {1: blocks})],
        key="k",
        ends_request=True,
    )


def worker(
    spec: StagingSpec, fmt: BlockFormat, order, device: str, seed: int
) -> tuple[WorkerSide, dict]:
    side = WorkerSide(PLAN, FabricSettings(node_actor="local"), spec)
    gen = torch.Generator().manual_seed(seed)
    kv = {n: layer_tensor(NB, H, PS, 2 * D, order, gen, device) for n in NAMES}
    side.register(kv, fmt)
    return side, kv


def round_trip(saver_fmt, saver_order, loader_fmt, loader_order, device: str) -> None:
    spec = StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", 8)
    saver, saved_kv = worker(spec, saver_fmt, saver_order, device, 1)
    loader, loaded_kv = worker(spec, loader_fmt, loader_order, device, 2)
    try:
        src, dst, slots = [3, 9, 4], [12, 0, 7], [5, 1, 2]
        saver.save(FabricMeta(saves=[copy_job(src, slots)]))
        assert saver.wait(30)
        assert saver.worker_meta().saved == {"k": 1}
        loader.start_load(FabricMeta(loads=[copy_job(dst, slots)]))
        assert loader.wait(30)
        _, recving, failed = loader.transfer_results()
        assert recving == {"r"} and not failed
        for name in NAMES:
            k0, v0 = backend_k_v(saved_kv[name], saver_fmt, D)
            k1, v1 = backend_k_v(loaded_kv[name], loader_fmt, D)
            assert torch.equal(k1[dst], k0[src]) and torch.equal(v1[dst], v0[src]), name
    finally:
        saver.shared.unlink()


@pytest.mark.parametrize(
    "saver", [(BlockFormat.KV_ROWS, ROWS_ORDERS[1]), (BlockFormat.KV_CHANNELS, ORDERS[1])]
)
@pytest.mark.parametrize(
    "loader", [(BlockFormat.KV_ROWS, ROWS_ORDERS[0]), (BlockFormat.KV_CHANNELS, ORDERS[2])]
)
def test_a_page_means_the_same_k_and_v_in_every_format(saver, loader):
    round_trip(*saver, *loader, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (benchmarks/gpu_check.sh)")
def test_cuda_blocks_round_trip_through_host_staging():
    # A flash-attention engine's blocks in VRAM, staging in host memory, both ways.
    round_trip(BlockFormat.KV_CHANNELS, ORDERS[1], BlockFormat.KV_CHANNELS, ORDERS[0], "cuda")


# --- tensor parallelism: ranks write their heads of one page --------------------------------


def split_engine(spec: StagingSpec, heads: int, ranks: int, seed: int) -> list[tuple]:
    """One engine's workers: a WorkerSide per tensor-parallel rank, each holding its
    heads' blocks (vLLM's split: heads // ranks each, or one replicated head)."""
    layout = KVLayout(layers=("full", "swa"), kv_heads=heads, head_dim=D, page_size=PS, window=8)
    plan = EnginePlan(layout, PLAN.layers, PLAN.group_pools, ranks)
    gen = torch.Generator().manual_seed(seed)
    sides = []
    for rank in range(ranks):
        side = WorkerSide(plan, FabricSettings(node_actor="local"), spec, rank)
        kv = {n: layer_tensor(NB, side.shard.count, PS, 2 * D, ORDERS[0], gen) for n in NAMES}
        side.register(kv, BlockFormat.KV_ROWS)
        sides.append((side, kv))
    return sides


def heads_of(sides: list[tuple], name: str, blocks: list[int]) -> torch.Tensor:
    """The engine's K/V of `blocks` with every KV head, as one unsplit engine holds them:
    [blocks, heads, rows, 2 * D], each replicated head once."""
    parts = [kv[name][blocks] for side, kv in sides if side.shard.writes]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize(
    "heads,saver_ranks,loader_ranks",
    [(2, 2, 1), (2, 1, 2), (4, 2, 4), (4, 4, 1), (1, 2, 1), (1, 1, 2), (2, 4, 2)],
)
def test_a_page_holds_every_head_whatever_the_split(heads, saver_ranks, loader_ranks):
    """Each rank of a split engine copies its own heads into the same staging page (a
    replicated head by one rank only), so the page holds what an unsplit engine's would:
    an engine split another way loads it, each rank its own heads. A job is saved once
    every rank reports it."""
    spec = StagingSpec(f"kvf-test-{uuid.uuid4().hex[:8]}", 8)
    savers = split_engine(spec, heads, saver_ranks, 1)
    loaders = split_engine(spec, heads, loader_ranks, 2)
    try:
        src, dst, slots = [3, 9, 4], [12, 0, 7], [5, 1, 2]
        reports = []
        for side, _ in savers:
            side.save(FabricMeta(saves=[copy_job(src, slots)]))
            assert side.wait(30)
            reports.append(side.worker_meta())
        total = reports[0]
        for r in reports[1:]:
            total = total.aggregate(r)
        assert total.saved == {"k": saver_ranks} and not total.failed
        for side, _ in loaders:
            side.start_load(FabricMeta(loads=[copy_job(dst, slots)]))
            assert side.wait(30)
            assert side.transfer_results()[1:] == ({"r"}, set())
        for name in NAMES:
            assert torch.equal(heads_of(loaders, name, dst), heads_of(savers, name, src)), name
        for side, kv in loaders:  # a replicated head reaches every rank that holds it
            s = side.shard
            want = heads_of(savers, NAMES[0], src)[:, s.first : s.first + s.count]
            assert torch.equal(kv[NAMES[0]][dst], want)
    finally:
        savers[0][0].shared.unlink()


def test_one_failed_rank_fails_the_save_for_all():
    from kvfabric.deploy.vllm.connector.jobs import FabricWorkerMeta

    ok, failed = FabricWorkerMeta({"k": 1, "j": 1}), FabricWorkerMeta({"j": 1}, {"k"})
    both = ok.aggregate(failed)
    assert both.saved == {"j": 2} and both.failed == {"k"}
    with pytest.raises(TypeError):
        ok.aggregate(object())  # type: ignore[arg-type]
