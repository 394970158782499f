"""The row copy in C (core/cache/csrc/copy.c) against the torch reference
(copy_rows(native=False)): the same bytes for every shape, item size, permutation and
row order, including the worker's layouts (vLLM's CPU blocks <-> staging pages, a rank's
slice of the heads); the same error and no byte changed for every bad call; the
buffers the kernel itself must refuse when called directly; and the copy queue, which runs
such copies in order on a C thread of its own."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.core.cache.native_copy import COPY
from kvfabric.core.cache.page_bytes import copy_rows

from tests.examples import examples
from tests.waiting import eventually

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
@given(st.lists(st.lists(copies(), min_size=0, max_size=3), min_size=1, max_size=4))
def test_the_queue_runs_each_submit_in_order_as_copy_rows_would(submits):
    """Submits to one queue (several copies each) land the bytes copy_rows lands for each
    copy in turn: every submit's copies write one destination, so a later one run first
    would leave other bytes."""
    from kvfabric.core.cache.page_bytes import buffer_of, copy_queue

    queue, tickets = copy_queue(), []
    dsts: dict[tuple, torch.Tensor] = {}  # per row shape and dtype: one destination
    wants: dict[tuple, torch.Tensor] = {}
    for cases in submits:
        batch = []
        for c in cases:
            src, dst, arrange = tensors(c[0], c[1], c[2], c[3], 12, c[7], c[8])
            key = (tuple(c[0]), c[2], c[7])
            dst, want = dsts.setdefault(key, dst), wants.setdefault(key, dst.clone())
            copy_rows(src, c[5], want, c[6], arrange, native=False)
            rows = (np.asarray(c[5], np.int64), np.asarray(c[6], np.int64))
            batch.append((buffer_of(arrange(src)), rows[0], buffer_of(dst), rows[1]))
        tickets.append(queue.submit(batch))
    assert tickets[-1].wait(30.0)
    assert all(t.done() for t in tickets)  # in order: the last done means all are
    for key, dst in dsts.items():
        assert torch.equal(raw(dst), raw(wants[key]))


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_copies_of_parts_of_the_same_rows_land_what_running_them_in_turn_lands(data):
    """A load's shape: each copy reads its part (a layer) of the same staged rows into a
    destination of its own, and the kernel runs them row by row, every part of a row in
    turn. Where they share a destination, or one writes what another reads, the bytes must
    still be those of the copies run one after another."""
    layers, n_src, n_dst = (data.draw(st.integers(lo, 6)) for lo in (2, 1, 1))
    n = data.draw(st.integers(0, n_dst))
    src_rows = data.draw(st.lists(st.integers(0, n_src - 1), min_size=n, max_size=n))
    dst_rows = data.draw(st.permutations(range(n_dst)))[:n]
    into = data.draw(st.sampled_from(["own", "shared", "the source", "some own"]))
    transposed = data.draw(st.booleans())  # each part read transposed (the copy reorders)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    rows = max(n_src, n_dst)
    src = torch.rand(rows, layers, 3, 3, generator=g)
    if into == "own":
        dsts = [torch.zeros(n_dst, 3, 3) for _ in range(layers)]
    elif into == "shared":
        dsts = [torch.zeros(n_dst, 3, 3)] * layers
    elif into == "the source":  # part l written into part l + 1, which the next copy reads
        dsts = [src[:, (part + 1) % layers] for part in range(layers)]
    else:  # the last copy writes into the first's destination
        dsts = [torch.zeros(n_dst, 3, 3) for _ in range(layers)]
        dsts[-1] = dsts[0]
    arrange = (lambda t: t.transpose(1, 2)) if transposed else (lambda t: t)
    want_src = src.clone()
    want = {id(d): d.clone() for d in dsts}
    want_dsts = [want[id(d)] for d in dsts]
    if into == "the source":
        want_dsts = [want_src[:, (part + 1) % layers] for part in range(layers)]
    for part in range(layers):  # the reference: one copy after another
        copy_rows(want_src[:, part], src_rows, want_dsts[part], dst_rows, arrange, native=False)
    from kvfabric.core.cache.page_bytes import buffer_of, copy_queue

    r = (np.asarray(src_rows, np.int64), np.asarray(dst_rows, np.int64))
    copies = [
        (buffer_of(arrange(src[:, part])), r[0], buffer_of(dsts[part]), r[1])
        for part in range(layers)
    ]
    assert copy_queue().submit(copies).wait(30.0)
    assert torch.equal(src, want_src)
    for got, expected in zip(dsts, want_dsts):
        assert torch.equal(got, expected)


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_two_pools_loaded_into_shared_layer_tensors_land_what_copies_in_turn_land(data):
    """vLLM's hybrid layout: a full layer and a sliding-window layer share one KV tensor,
    each group's blocks its own. A load copies the full pool's parts (one group), then the
    SWA pool's (another) into them; each group runs row by row. Where both groups' rows
    meet in a block (or the order is mixed), the bytes must still be those of the copies
    run one after another."""
    layers, n = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5))
    blocks = data.draw(st.permutations(range(2 * n + 2)))
    full_rows, swa_rows = blocks[:n], blocks[n : 2 * n]
    if data.draw(st.booleans()):  # a block both groups write
        swa_rows = swa_rows[:-1] + [full_rows[0]]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    pools = [torch.rand(n + 1, layers, 2, 3, generator=g) for _ in range(2)]
    tensors = [torch.zeros(2 * n + 2, 2, 3) for _ in range(layers)]
    slots = np.asarray(data.draw(st.permutations(range(n + 1)))[:n], np.int64)
    copies = [  # (source, its rows, the layer written, its rows)
        (pools[pool][:, part], slots, part, np.asarray(rows, np.int64))
        for pool, rows in ((0, full_rows), (1, swa_rows))
        for part in range(layers)
    ]
    if data.draw(st.booleans()):  # the groups' copies mixed in the list
        copies = [c for pair in zip(copies[:layers], copies[layers:]) for c in pair]
    want = [t.clone() for t in tensors]
    for src, s_rows, part, d_rows in copies:  # the reference: one copy after another
        copy_rows(src, s_rows.tolist(), want[part], d_rows.tolist(), native=False)
    from kvfabric.core.cache.page_bytes import buffer_of, copy_queue

    ticket = copy_queue().submit(
        [(buffer_of(a), r, buffer_of(tensors[part]), q) for a, r, part, q in copies]
    )
    assert ticket.wait(30.0)
    for got, expected in zip(tensors, want):
        assert torch.equal(got, expected)


def test_a_bad_submit_queues_nothing_and_names_what_is_wrong():
    """Each copy is checked before any byte moves: a bad last copy leaves the first one
    undone too, and the queue runs on."""
    src, rows = np.arange(24, dtype=np.float32).reshape(4, 3, 2), np.array([0, 1], np.int64)
    first, second = np.zeros((3, 3, 2), np.float32), np.zeros((3, 3, 2), np.float32)
    bad_rows = np.array([0, 7], np.int64)
    cases = [
        ([(src, rows, first, rows), (src, bad_rows, second, rows)], IndexError, "range"),
        ([(src, rows, first, rows), (src, rows, second)], TypeError, "copy 1 is not"),
        ([(src, rows, first, rows), [src, rows, second, rows]], TypeError, "copy 1 is not"),
        (
            [(src, rows, first, rows), (src, rows, second.astype(np.float64), rows)],
            ValueError,
            "item size",
        ),
        (7, TypeError, "sequence of copies"),
    ]
    queue = COPY.CopyQueue()
    for copies_, error, says in cases:
        with pytest.raises(error, match=says):
            queue.submit(copies_)
        assert queue.submit([]).wait(30.0)  # a later submit has run: the bad one never did
        assert not first.any() and not second.any()
    with pytest.raises(TypeError):
        COPY.CopyQueue(1)
    with pytest.raises(TypeError):
        type(queue.submit([]))()  # a ticket comes from submit only


def test_a_ticket_says_when_its_copies_ran():
    src = np.arange(1 << 20, dtype=np.float32).reshape(64, 4, 4096)
    dst, rows = np.zeros_like(src), np.arange(64, dtype=np.int64)
    queue = COPY.CopyQueue()
    before = time.monotonic_ns()
    ticket = queue.submit([(src, rows, dst, rows[::-1].copy())])
    assert ticket.wait(30.0) and ticket.done() and ticket.wait(0) and ticket.wait()
    after = time.monotonic_ns()
    assert before <= ticket.started_ns <= ticket.ended_ns <= after
    assert 0 <= ticket.cpu_ns
    assert np.array_equal(dst, src[::-1])
    for bad, error in (
        (-1, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("1", TypeError),
    ):
        with pytest.raises(error):
            ticket.wait(bad)
    with pytest.raises(TypeError):
        ticket.wait(1, 2)


def test_a_ticket_dropped_early_keeps_its_buffers_until_they_are_copied():
    """The ticket holds what its copies read and write: the caller may drop every one of
    them (and the ticket) at once; the bytes still land, and no freed memory is read (the
    sanitizers' run checks that)."""
    queue, out = COPY.CopyQueue(), np.zeros((8, 1 << 16), np.uint8)
    for i in range(50):
        src = np.full((8, 1 << 16), i, np.uint8)
        queue.submit([(src, np.arange(8, dtype=np.int64), out, np.arange(8, dtype=np.int64))])
        del src  # and the ticket is dropped unwaited: it waits for its copies as it goes
    assert (out == 49).all()


def test_threads_submitting_at_once_each_get_their_bytes():
    """Several threads submit to one queue at once, each to its own destination."""
    queue, rows = COPY.CopyQueue(), np.arange(16, dtype=np.int64)
    srcs = [np.random.default_rng(i).random((16, 512)) for i in range(4)]
    dsts = [np.zeros((16, 512)) for _ in srcs]

    def submit(i):
        tickets = [queue.submit([(srcs[i], rows, dsts[i], rows)]) for _ in range(20)]
        assert all(t.wait(30.0) for t in tickets)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(submit, range(4)))
    assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts))


def _comm(tid: int) -> str | None:
    """The name a thread of this process runs under; None once it is gone."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def test_a_queue_starts_its_thread_at_its_first_submit_and_joins_it_when_freed():
    queue = COPY.CopyQueue()
    assert queue.native_id is None  # no thread until there is something to copy
    assert queue.submit([]).wait(30.0)
    tid = queue.native_id
    assert tid is not None and tid != threading.get_native_id()
    assert _comm(tid) == "kvf-copy-queue"  # as top -H shows it
    del queue  # its last ticket went with the statement above: the thread is joined
    # A joined thread's task leaves /proc a moment after the join returns.
    eventually(lambda: _comm(tid) != "kvf-copy-queue", "the joined thread gone", every_s=0.01)


def test_the_queues_thread_runs_on_the_cores_of_the_thread_that_started_it():
    """The connector's copy thread moves to the cores the forward leaves free, then submits:
    the queue's thread starts there too."""
    core = min(os.sched_getaffinity(0))
    queue = COPY.CopyQueue()

    def first_submit():
        os.sched_setaffinity(0, {core})  # this thread only
        return queue.submit([]).wait(30.0)

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(first_submit).result(30.0)
    assert queue.native_id is not None
    assert os.sched_getaffinity(queue.native_id) == {core}
    assert len(os.sched_getaffinity(0)) >= 1  # the test's own thread kept its cores


def test_a_forked_child_is_refused_the_parents_queue():
    """The queue's thread is the parent's: a child's submit raises, never queues to no one."""
    queue = COPY.CopyQueue()
    assert queue.submit([]).wait(30.0)
    pid = os.fork()
    if pid == 0:  # the child: 0 if refused as it should be
        if queue.native_id is not None:  # the thread it names is the parent's
            os._exit(3)
        try:
            queue.submit([])
        except RuntimeError as e:
            os._exit(0 if "forked child" in str(e) else 2)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
