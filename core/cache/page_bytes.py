"""Moving page bytes: per-layer K/V tensors <-> pool pages, and page copies."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from .disk_records import PageMeta
from .disk_store import Unrecorded
from .layout import KVLayout, PoolName
from .native_copy import COPY, CopyQueue
from .pools import PagePool


class PageCopier(Protocol):
    """Copies pages between two pools of the same name (any tiers)."""

    def copy(
        self, src: PagePool, src_idx: list[int], dst: PagePool, dst_idx: list[int]
    ) -> None: ...


class TorchCopier:
    """Plain torch index copies; transport.LocalTransport adds streams on CUDA."""

    def copy(self, src: PagePool, src_idx: list[int], dst: PagePool, dst_idx: list[int]) -> None:
        if src.data is None or dst.data is None or not src_idx:
            return
        if src.data.device.type == dst.data.device.type == "cpu":
            copy_rows(src.data, src_idx, dst.data, dst_idx)  # one pass, no gathered copy
            return
        pages = src.data.index_select(0, src.index_tensor(src_idx))
        dst.data.index_copy_(0, dst.index_tensor(dst_idx), pages.to(dst.data.device))


def move_pages(
    copier: PageCopier,
    src: PagePool,
    src_idx: list[int],
    dst: PagePool,
    dst_idx: list[int],
    metas: Sequence[PageMeta] = (),
) -> None:
    """Copy pages between two tiers of one pool: through `copier` between tensors, through
    the page files to and from the disk tier (`metas` name the pages written there)."""
    if dst.disk is not None:
        _to_disk(src, src_idx, dst, dst_idx, metas)
    elif src.disk is not None:
        _from_disk(src, src_idx, dst, dst_idx)
    else:
        copier.copy(src, src_idx, dst, dst_idx)


def _to_disk(
    src: PagePool, src_idx: list[int], dst: PagePool, dst_idx: list[int], metas: Sequence[PageMeta]
) -> None:
    assert dst.disk is not None
    if src.data is None or not src_idx:
        return
    if len(metas) != len(dst_idx):
        raise ValueError(f"{len(dst_idx)} pages to disk with {len(metas)} metas")
    pages = src.data.index_select(0, src.index_tensor(src_idx)).cpu()
    try:
        dst.disk.write(dst.name, dst_idx, pages, metas)
    except Unrecorded:
        pass  # the bytes are there for this run; only a restart will not find them


def _from_disk(src: PagePool, src_idx: list[int], dst: PagePool, dst_idx: list[int]) -> None:
    assert src.disk is not None
    if dst.data is None or not src_idx:
        return
    pinned = dst.data.device.type == "cuda"
    pages = torch.empty(
        (len(src_idx), *dst.data.shape[1:]), dtype=dst.data.dtype, pin_memory=pinned
    )
    src.disk.read(src.name, src_idx, pages)
    if dst.data.device.type == "cpu":
        copy_rows(pages, range(len(src_idx)), dst.data, dst_idx)
    else:
        dst.data.index_copy_(0, dst.index_tensor(dst_idx), pages.to(dst.data.device))


def keep_bytes(pool: PagePool, indices: list[int]) -> Callable[[], None]:
    """Save the bytes of pages `indices`; the returned call writes them back."""
    if pool.disk is not None:
        return _keep_disk_bytes(pool, indices)
    if pool.data is None:
        return lambda: None
    data, index = pool.data, pool.index_tensor(indices)
    saved = data.index_select(0, index)

    def restore() -> None:
        data.index_copy_(0, index, saved)

    return restore


def _keep_disk_bytes(pool: PagePool, indices: list[int]) -> Callable[[], None]:
    """keep_bytes for the disk tier: the pages, their checksums and records, written back
    as they were (a corrupted page stays one: it keeps the checksum of what was written)."""
    disk = pool.disk
    assert disk is not None
    saved = disk.save(pool.name, indices)
    if not saved.slots:
        return lambda: None
    return lambda: disk.restore(saved)


# Per-layer K/V, [2, T, kv_heads, head_dim] each; a layer of a pool no step reads may be None.
LayerKV = Sequence[torch.Tensor | None]


def run_view(t: torch.Tensor, indices: Sequence[int]) -> torch.Tensor | None:
    """Rows `indices` of `t` as a view, where they are one ascending run (no copy);
    None where they are not (the caller gathers)."""
    if not indices or list(indices) != list(range(indices[0], indices[0] + len(indices))):
        return None
    return t[indices[0] : indices[0] + len(indices)]


def copy_rows(
    src: torch.Tensor,
    src_rows: Sequence[int],
    dst: torch.Tensor,
    dst_rows: Sequence[int],
    arrange: Callable[[torch.Tensor], torch.Tensor] | None = None,
    *,
    native: bool | None = None,
) -> None:
    """dst[dst_rows[i]] = arrange(src)[src_rows[i]] in one pass over the bytes, with no
    gathered temporary. `arrange` views `src` in `dst`'s layout keeping rows first (a
    permute: the copy does the reordering). On the CPU the C kernel copies every row in
    one call (core/cache/csrc/copy.c); elsewhere, and with KVF_NATIVE=0 or
    `native=False`, one copy_ per stretch where both row lists count up by one (the
    reference; tests compare the two)."""
    if len(src_rows) != len(dst_rows):
        raise ValueError(f"copy_rows: {len(src_rows)} source rows for {len(dst_rows)}")
    view = src if arrange is None else arrange(src)
    if view.dtype != dst.dtype or view.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"copy_rows: rows of {view.dtype} {tuple(view.shape[1:])} into rows of "
            f"{dst.dtype} {tuple(dst.shape[1:])}"
        )
    for rows, t in ((src_rows, view), (dst_rows, dst)):
        if rows and (min(rows) < 0 or max(rows) >= t.shape[0]):
            raise IndexError(f"copy_rows: a row outside 0..{t.shape[0] - 1}")
    if native and COPY is None:
        raise RuntimeError("copy_rows: the C row copy is not built or KVF_NATIVE=0")
    on_cpu = view.device.type == "cpu" and dst.device.type == "cpu"
    if COPY is not None and native is not False and on_cpu:
        COPY.copy_rows(
            _as_buffer(view),
            np.asarray(src_rows, dtype=np.int64),
            _as_buffer(dst),
            np.asarray(dst_rows, dtype=np.int64),
        )
        return
    i, n = 0, len(src_rows)
    while i < n:
        j = i + 1
        while j < n and src_rows[j] == src_rows[j - 1] + 1 and dst_rows[j] == dst_rows[j - 1] + 1:
            j += 1
        s, d = src_rows[i], dst_rows[i]
        dst[d : d + j - i].copy_(view[s : s + j - i])
        i = j


def buffer_of(t: torch.Tensor) -> np.ndarray | None:
    """`t`'s memory as the C row copy takes it, for arrays copied often (made once, not
    at each copy); None where the kernel does not run: off the CPU, or KVF_NATIVE=0."""
    if COPY is None or t.device.type != "cpu":
        return None
    return _as_buffer(t)


# (src, src_rows, dst, dst_rows): buffers from buffer_of, rows as int64 arrays.
RowCopy = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def copy_queue() -> CopyQueue:
    """A queue whose submit(copies) checks copy_rows's copies (RowCopy tuples) before a byte
    moves, then runs them later, in order, on a C thread that never takes the GIL: a copy
    ending beside an engine's thread running Python need not wait for the GIL to say so
    (its ticket's done())."""
    if COPY is None:
        raise RuntimeError("copy_queue: the C row copy is not built or KVF_NATIVE=0")
    return COPY.CopyQueue()


def _as_buffer(t: torch.Tensor) -> np.ndarray:
    """`t`'s memory as numpy sees it, in place: as integers of its item size, so that
    dtypes numpy lacks (bfloat16, fp8) pass too."""
    return t.view(_RAW[t.element_size()]).numpy()


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack(layout: KVLayout, pool: PoolName, kv: LayerKV, positions: list[int]) -> torch.Tensor:
    """Pages at `positions` of per-layer kv [2, T, H, D] -> [n, *page_shape(pool)]."""
    ps = layout.page_size
    layers = layout.layers_of(pool)
    out = []
    pos: torch.Tensor | None = None
    for li in layers:
        t = kv[li]
        assert t is not None, f"layer {li} of {pool.name} has no K/V"
        if pos is None:
            pos = torch.tensor(positions, dtype=torch.long, device=t.device)
        paged = t[:, : (t.shape[1] // ps) * ps].reshape(2, -1, ps, *t.shape[2:])
        out.append(paged.index_select(1, pos))  # [2, n, ps, H, D]
    return torch.stack(out).permute(2, 0, 1, 3, 4, 5)  # [n, L, 2, ps, H, D]


def unpack(pages: torch.Tensor) -> list[torch.Tensor]:
    """[n, L, 2, ps, H, D] -> per-layer [2, n*ps, H, D] (layers of one pool)."""
    n, n_layers, _, ps, h, d = pages.shape
    per_layer = pages.permute(1, 2, 0, 3, 4, 5).reshape(n_layers, 2, n * ps, h, d)
    return list(per_layer.unbind(0))


def page_checksums(pool: PagePool, indices: list[int]) -> list[int]:
    """A cheap per-page checksum over the raw bytes (for transfer verification)."""
    if pool.data is None or not indices:
        return [0] * len(indices)
    pages = pool.data.index_select(0, pool.index_tensor(indices)).cpu()
    words = pages.contiguous().view(torch.int32).reshape(len(indices), -1).to(torch.int64)
    weights = torch.arange(1, words.shape[1] + 1, dtype=torch.int64)
    return ((words * weights).sum(dim=1) % (2**61 - 1)).tolist()
