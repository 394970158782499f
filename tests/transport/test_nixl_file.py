"""NIXL's POSIX backend as a page file: the same operations through it and through plain
file I/O leave the same bytes (differential), its failures are page file errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.cache.disk_store import DiskStore
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.page_file import PageFileError, PageGeometry, PosixPageFile
from kvfabric.transport.base import BackendError, TransferTimeout
from kvfabric.transport.nixl_file import NixlFileError, NixlFileTimeout, NixlPageFile

GEOMETRY = PageGeometry((2, 4, 8), torch.bfloat16)  # 128 bytes a page
CAPACITY = 24

# An op: (write?, slots); pages come from a counter, so every write differs.
op = st.tuples(st.booleans(), st.lists(st.integers(0, CAPACITY - 1), unique=True, max_size=12))


@given(ops=st.lists(op, max_size=12))
def test_nixl_and_plain_files_agree(tmp_path_factory, ops):
    folder = tmp_path_factory.mktemp("f")
    plain = PosixPageFile(folder / "plain", CAPACITY, GEOMETRY)
    nixl = NixlPageFile(folder / "nixl", CAPACITY, GEOMETRY)
    try:
        for n, (is_write, slots) in enumerate(ops):
            shape = (len(slots), *GEOMETRY.shape)
            if is_write:
                pages = (torch.arange(len(slots) * 64) + 1000 * n).to(torch.bfloat16)
                plain.write(slots, pages.reshape(shape))
                nixl.write(slots, pages.reshape(shape))
            else:
                a, b = torch.empty(shape, dtype=torch.bfloat16), torch.ones(shape).bfloat16()
                plain.read(slots, a)
                nixl.read(slots, b)
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert (folder / "plain").read_bytes() == (folder / "nixl").read_bytes()
    finally:
        plain.close()
        nixl.close()


def test_bad_arguments_are_refused_before_nixl_sees_them(tmp_path):
    nixl = NixlPageFile(tmp_path / "nixl", CAPACITY, GEOMETRY)
    with pytest.raises(ValueError, match="slot 24 out of range"):
        nixl.write([24], torch.zeros(1, *GEOMETRY.shape, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="want pages"):
        nixl.read([1], torch.zeros(1, *GEOMETRY.shape))
    nixl.close()
    with pytest.raises(NixlFileError, match="closed"):
        nixl.read([1], torch.zeros(1, *GEOMETRY.shape, dtype=torch.bfloat16))
    nixl.close()  # idempotent


def test_a_transfer_past_its_deadline_is_held_and_raises(tmp_path):
    nixl = NixlPageFile(tmp_path / "nixl", CAPACITY, GEOMETRY, deadline_s=0.0)
    pages = torch.zeros(4, *GEOMETRY.shape, dtype=torch.bfloat16)
    # The POSIX backend queues a posted transfer (in progress), so a zero deadline passes.
    with pytest.raises(NixlFileTimeout, match="not done after") as err:
        nixl.write([0, 1, 2, 3], pages)
    assert isinstance(err.value, TransferTimeout) and isinstance(err.value, PageFileError)
    assert len(nixl._held) == 1
    nixl.close()
    assert nixl._held == []


def test_nixl_errors_map_to_both_error_families(tmp_path, monkeypatch):
    from kvfabric.transport.nixl_transport import _nb

    nixl = NixlPageFile(tmp_path / "nixl", CAPACITY, GEOMETRY)

    class Agent:
        def __getattr__(self, name):
            return getattr(real, name)

        def createXferReq(self, *args):
            raise _nb.nixlBackendError("injected")

    real = nixl._agent
    monkeypatch.setattr(nixl, "_agent", Agent())
    with pytest.raises(NixlFileError, match="writing 1 pages .* injected") as err:
        nixl.write([3], torch.zeros(1, *GEOMETRY.shape, dtype=torch.bfloat16))
    assert isinstance(err.value, BackendError) and isinstance(err.value, PageFileError)
    monkeypatch.setattr(nixl, "_agent", real)
    nixl.close()


def test_a_store_written_through_nixl_reopens_through_plain_files(tmp_path):
    layout = KVLayout(layers=("full",), kv_heads=2, head_dim=8, page_size=4, dtype="float16")
    from kvfabric.core.cache.disk_records import PageMeta

    store = DiskStore(tmp_path, layout, {PoolName.FULL: 16}, page_file=NixlPageFile)
    store.adopt()
    pages = torch.randn(5, *layout.page_shape(PoolName.FULL)).half()
    metas = [PageMeta(bytes(16), i, bytes([i]) * 16, b"") for i in range(5)]
    slots = store.alloc(PoolName.FULL, 5)
    store.write(PoolName.FULL, slots, pages, metas)
    store.close()
    store = DiskStore(tmp_path, layout, {PoolName.FULL: 16})
    adopted = sorted(store.adopt().trusted, key=lambda p: p.meta.position)
    assert [p.slot for p in adopted] == slots
    out = torch.empty_like(pages)
    store.read(PoolName.FULL, slots, out)
    assert torch.equal(out, pages)
    store.close()
