"""Page copies inside one node: device <-> host and pool <-> pool.

On CPU these are plain torch index ops. When CUDA is involved, the copy runs on a side
stream (so it overlaps whatever the compute stream does next) and crosses PCIe through
pinned host memory (pageable memory cannot be copied asynchronously); the stream is
synchronized before returning, so callers see a finished copy.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .base import Indices, as_index_array, check_range


def _tensor_of(pool: Any) -> torch.Tensor | None:
    """A pool tensor, or the `.data` of a pool object (kvfabric.core.cache.pools.PagePool)."""
    if isinstance(pool, torch.Tensor):
        return pool
    data = getattr(pool, "data", None)
    if data is None or isinstance(data, torch.Tensor):
        return data
    raise ValueError(f"expected a tensor or an object with a tensor .data, got {type(pool)}")


def _index(idx: Indices, capacity: int, device: torch.device, what: str) -> torch.Tensor:
    arr = as_index_array(idx, what)
    check_range(arr, capacity, what)
    return torch.from_numpy(arr).to(device)


def _check_pair(src: torch.Tensor, dst: torch.Tensor, n_src: int, n_dst: int) -> None:
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"page mismatch: src {src.dtype}{tuple(src.shape[1:])} vs "
            f"dst {dst.dtype}{tuple(dst.shape[1:])}"
        )
    if n_src != n_dst:
        raise ValueError(f"{n_src} source pages but {n_dst} destination pages")


class LocalTransport:
    """Copies pages between pools of one process (matches fabric's PageCopier.copy)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one staging buffer, one copy at a time
        self._staging: torch.Tensor | None = None
        self._streams: dict[int, Any] = {}

    def copy(self, src: Any, src_idx: Indices, dst: Any, dst_idx: Indices) -> None:
        """dst[dst_idx[i]] = src[src_idx[i]]. A pool object without storage is a no-op."""
        s, d = _tensor_of(src), _tensor_of(dst)
        if s is None or d is None:
            return
        si = _index(src_idx, s.shape[0], s.device, "source")
        di = _index(dst_idx, d.shape[0], d.device, "destination")
        _check_pair(s, d, len(si), len(di))
        if len(si) == 0:
            return
        if s.device.type == "cpu" and d.device.type == "cpu":
            d.index_copy_(0, di, s.index_select(0, si))
            return
        with self._lock:
            self._copy_cuda(s, si, d, di)

    def _copy_cuda(
        self, s: torch.Tensor, si: torch.Tensor, d: torch.Tensor, di: torch.Tensor
    ) -> None:
        gpu = s.device if s.device.type == "cuda" else d.device
        stream = self._stream(gpu)
        # Pages may have just been written by work queued on the compute stream.
        stream.wait_stream(torch.cuda.current_stream(gpu))
        with torch.cuda.stream(stream):
            if s.device.type == "cpu":  # host -> device
                pages = self._stage(s, len(si))
                torch.index_select(s, 0, si, out=pages)
                d.index_copy_(0, di, pages.to(gpu, non_blocking=True))
            elif d.device.type == "cpu":  # device -> host
                pages = self._stage(s, len(si))
                pages.copy_(s.index_select(0, si), non_blocking=True)
                stream.synchronize()  # before the CPU reads the staging
                d.index_copy_(0, di, pages)
            else:  # device -> device (any two GPUs)
                d.index_copy_(0, di, s.index_select(0, si).to(d.device, non_blocking=True))
        stream.synchronize()

    def _stream(self, device: torch.device) -> Any:
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=key)
        return self._streams[key]

    def _stage(self, like: torch.Tensor, n: int) -> torch.Tensor:
        """A pinned host buffer shaped [n, *page], grown (never shrunk) as needed."""
        nbytes = n * like[0].numel() * like.element_size()
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._staging[:nbytes].view(like.dtype).view(n, *like.shape[1:])


_default = LocalTransport()


def copy_pages(src_tensor: Any, src_idx: Indices, dst_tensor: Any, dst_idx: Indices) -> None:
    """dst_tensor[dst_idx[i]] = src_tensor[src_idx[i]], for any cpu/cuda combination."""
    _default.copy(src_tensor, src_idx, dst_tensor, dst_idx)
