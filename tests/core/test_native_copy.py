"""The row copy in C (core/cache/csrc/copy.c) against the torch reference
(copy_rows(native=False)): the same bytes for every shape, item size, permutation and
row order, including the worker's layouts (vLLM's CPU blocks <-> staging pages, a rank's
slice of the heads); the same error and no byte changed for every bad call; and the
buffers the kernel itself must refuse when called directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.core.cache.native_copy import COPY
from kvfabric.core.cache.page_bytes import copy_rows

from tests.examples import examples

pytestmark = pytest.mark.skipif(
    COPY is None, reason="KVF_NATIVE=0 or not built: the reference alone"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64]


def outcome(fn):
    try:
        fn()
    except Exception as e:
        return type(e), str(e)
    return None


@st.composite
def copies(draw):
    """A source and a destination of one row shape, `arrange` a permutation of the row's
    dimensions (the copy reorders), the destination maybe a slice of a wider tensor."""
    dims = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(1, 5), min_size=dims, max_size=dims))
    perm = draw(st.permutations(range(dims)))
    dtype = draw(st.sampled_from(DTYPES))
    n_src, n_dst = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    n = draw(st.integers(0, n_dst))
    src_rows = draw(st.lists(st.integers(0, n_src - 1), min_size=n, max_size=n))
    dst_rows = draw(st.permutations(range(n_dst)))[:n]
    widen = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**16))
    return shape, perm, dtype, n_src, n_dst, src_rows, dst_rows, widen, seed


def tensors(shape, perm, dtype, n_src, n_dst, widen, seed):
    g = torch.Generator().manual_seed(seed)
    # src is stored in the permuted order; arrange views it back in dst's order.
    stored = [shape[p] for p in perm]
    src = (torch.rand(n_src, *stored, generator=g) * 100).to(dtype)
    wide = list(shape)
    wide[-1] += widen  # dst a slice of a wider tensor: rows strided, the last dim cut
    dst = torch.zeros(n_dst, *wide, dtype=dtype)[..., : shape[-1]]
    inverse = [0] + [1 + perm.index(d) for d in range(len(shape))]
    return src, dst, lambda t: t.permute(*inverse)


@settings(max_examples=examples(300), deadline=None)
@given(copies())
def test_the_kernel_copies_the_bytes_the_reference_copies(case):
    shape, perm, dtype, n_src, n_dst, src_rows, dst_rows, widen, seed = case
    got = []
    for native in (True, False):
        src, dst, arrange = tensors(shape, perm, dtype, n_src, n_dst, widen, seed)
        copy_rows(src, src_rows, dst, dst_rows, arrange, native=native)
        got.append(raw(dst))
    assert torch.equal(got[0], got[1])
    # and the copy is the one asked for, row by row
    src, _, arrange = tensors(shape, perm, dtype, n_src, n_dst, widen, seed)
    for s, d in zip(src_rows, dst_rows):
        assert torch.equal(got[0][d], raw(arrange(src)[s]))


def raw(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as bytes (NaN compares equal to itself), in a fresh dense tensor."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).view(torch.uint8)


def test_the_workers_layouts_scattered_both_ways():
    """vLLM's CPU blocks [n, heads, 2, page, D] <-> staging [slots, 2, page, heads, D]
    with this rank's half of the heads, blocks in descending order (as vLLM hands out
    freed ones): saved and loaded back, the bytes are the blocks'."""
    blocks = torch.randn(40, 2, 2, 16, 8)
    staging = torch.zeros(30, 3, 2, 16, 4, 8)  # [slots, layers, 2, page, heads, D]
    mine = staging[:, 1, :, :, 2:4]
    rows, slots = list(range(30, 10, -1)), list(range(5, 25))
    copy_rows(blocks, rows, mine, slots, lambda b: b.permute(0, 2, 3, 1, 4))
    assert torch.equal(mine[5:25], blocks[rows].permute(0, 2, 3, 1, 4))
    assert staging[:, 0].abs().sum() == 0 and staging[:, :, :, :, :2].abs().sum() == 0
    back = torch.zeros_like(blocks)
    copy_rows(mine, slots, back, rows, lambda p: p.permute(0, 3, 1, 2, 4))
    assert torch.equal(back[11:31], blocks[11:31]) and back[:11].abs().sum() == 0


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "bad",
    [
        ("rows of two lengths", lambda s, d: copy_rows(s, [0, 1], d, [0])),
        ("a source row past the end", lambda s, d: copy_rows(s, [0, 4], d, [0, 1])),
        ("a negative row", lambda s, d: copy_rows(s, [0, 1], d, [-1, 1])),
        ("another dtype", lambda s, d: copy_rows(s.double(), [0], d, [0])),
        ("another row shape", lambda s, d: copy_rows(s[:, :2], [0], d, [0])),
    ],
    ids=lambda b: b[0] if isinstance(b, tuple) else str(b),
)
def test_a_bad_call_raises_and_changes_nothing(bad, native):
    src, dst = torch.arange(24.0).view(4, 3, 2), torch.zeros(3, 3, 2)
    before = dst.clone()
    with pytest.raises((ValueError, IndexError)):
        _with(native, bad[1], src, dst)
    assert torch.equal(dst, before)


def _with(native, call, src, dst):
    import kvfabric.core.cache.page_bytes as pages

    saved = pages.COPY
    pages.COPY = COPY if native else None
    try:
        call(src, dst)
    finally:
        pages.COPY = saved


def test_the_kernel_refuses_what_it_cannot_copy_safely():
    """Called directly, with no Python check before it: each refusal says why and
    changes nothing."""
    src, dst = np.arange(24, dtype=np.float32).reshape(4, 3, 2), np.zeros((3, 3, 2), np.float32)
    rows = np.array([0, 1], dtype=np.int64)
    cases = [
        (src, rows, dst, rows[:1], ValueError),  # lengths
        (src, np.array([0, 4]), dst, rows, IndexError),  # out of range
        (src, np.array([-1, 0]), dst, rows, IndexError),
        (src, rows.astype(np.int32), dst, rows, TypeError),  # 4-byte rows
        (src, rows.reshape(2, 1), dst, rows, TypeError),  # rows not 1-d
        (src.astype(np.float64), rows, dst, rows, ValueError),  # item sizes
        (src[:, :2], rows, dst, rows, ValueError),  # row shapes
        (src, rows, b"read-only bytes", rows, BufferError),
        (np.float32(1.0), rows, dst, rows, ValueError),  # 0-d
        (src, rows, dst, [0, 1], TypeError),  # not a buffer
    ]
    for s, sr, d, dr, error in cases:
        before = dst.copy()
        with pytest.raises(error):
            COPY.copy_rows(s, sr, d, dr)
        assert np.array_equal(dst, before)
    read_only = dst.copy()
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        COPY.copy_rows(src, rows, read_only, rows)
    with pytest.raises(TypeError):
        COPY.copy_rows(src, rows, dst)


# In int32 items: 0 puts every run on 64 bytes, 8 on 32, 4 on 16 (each store width the
# CPU has), 1 on none (stored as usual).
@pytest.mark.parametrize("offset", [0, 8, 4, 1])
def test_a_large_copy_streams_its_stores_and_copies_the_same_bytes(offset):
    """Past 4 MiB the kernel stores past the caches, as wide as each run's alignment
    allows; the bytes are the reference's whatever the alignment."""
    g = torch.Generator().manual_seed(7)
    src = torch.randint(-(2**31), 2**31 - 1, (96, 2, 16, 2, 1024 + offset), generator=g)
    src = src.to(torch.int32)[..., offset:]  # 96 rows of 256 KiB: 24 MiB
    rows = list(range(95, -1, -2)) + list(range(0, 96, 2))
    slots = list(range(96))
    got = []
    for native in (True, False):
        dst = torch.zeros(100, 16, 2, 2, 1024 + offset, dtype=torch.int32)[..., offset:]
        copy_rows(src, rows, dst, slots, lambda t: t.permute(0, 2, 1, 3, 4), native=native)
        got.append(dst)
    assert torch.equal(got[0], got[1])
    assert torch.equal(got[0][3], src[rows[3]].permute(1, 0, 2, 3))


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(copies(), min_size=0, max_size=4))
def test_copy_many_copies_what_copy_rows_copies_one_by_one(cases):
    """Several copies in one call (the GIL released once) land the bytes copy_rows lands
    for each in turn."""
    from kvfabric.core.cache.page_bytes import buffer_of, copy_many

    made = [tensors(c[0], c[1], c[2], c[3], c[4], c[7], c[8]) for c in cases]
    rows = [(np.asarray(c[5], np.int64), np.asarray(c[6], np.int64)) for c in cases]
    copy_many(
        [
            (buffer_of(arrange(src)), s, buffer_of(dst), d)
            for (src, dst, arrange), (s, d) in zip(made, rows)
        ]
    )
    for case, (src, dst, arrange) in zip(cases, made):
        want = tensors(case[0], case[1], case[2], case[3], case[4], case[7], case[8])[1]
        copy_rows(src, case[5], want, case[6], arrange, native=False)
        assert torch.equal(raw(dst), raw(want))


def test_copy_many_refuses_every_copy_if_one_is_bad():
    """Each copy is checked before any byte moves: a bad last copy leaves the first one
    undone too, and the error names what is wrong."""
    src, rows = np.arange(24, dtype=np.float32).reshape(4, 3, 2), np.array([0, 1], np.int64)
    first, second = np.zeros((3, 3, 2), np.float32), np.zeros((3, 3, 2), np.float32)
    bad_rows = np.array([0, 7], np.int64)
    cases = [
        ([(src, rows, first, rows), (src, bad_rows, second, rows)], IndexError),
        ([(src, rows, first, rows), (src, rows, second)], TypeError),  # three items
        ([(src, rows, first, rows), [src, rows, second, rows]], TypeError),  # not a tuple
        ([(src, rows, first, rows), (src, rows, second.astype(np.float64), rows)], ValueError),
    ]
    for copies_, error in cases:
        with pytest.raises(error):
            COPY.copy_many(copies_)
        assert not first.any() and not second.any()
    with pytest.raises(TypeError):
        COPY.copy_many(7)  # not a sequence
    COPY.copy_many([])  # nothing to copy
