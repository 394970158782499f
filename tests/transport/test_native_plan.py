"""The read plan in C (transport/csrc/plan.c) against the numpy reference
(plan_pool_read(native=False)): the same ordered pairs and descriptor count for every
valid read, the same error for every invalid one; remote pages that repeat (the sort
must be stable), pools far larger than the read (the sort-based duplicate check), and
buffers C must refuse."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.transport.base import MemKind, PoolLayout, plan_pool_read
from kvfabric.transport.native_plan import PLAN
from kvfabric.transport.runs import merge_runs

from tests.examples import examples

pytestmark = pytest.mark.skipif(
    PLAN is None, reason="KVF_NATIVE=0 or not built: the reference alone"
)


def layout(capacity: int) -> PoolLayout:
    return PoolLayout(0, 8, capacity, MemKind.DRAM, 0)


def outcome(spec, local: PoolLayout, remote: PoolLayout, native: bool):
    try:
        p = plan_pool_read("p", spec, local, remote, native=native)
    except ValueError as e:
        return ("error", str(e))
    assert p.remote.dtype == np.int32 and p.local.dtype == np.int32
    return (p.remote.tolist(), p.local.tolist(), p.descriptors)


@st.composite
def reads(draw):
    """Mostly valid reads, some out of range or writing a local page twice."""
    cap_r = draw(st.sampled_from([1, 7, 64, 1024, 1 << 20, 1 << 31]))
    cap_l = draw(st.sampled_from([1, 7, 64, 1024, 1 << 20, 1 << 31]))
    n = draw(st.integers(0, 80))
    base_r, base_l = draw(st.integers(0, cap_r - 1)), draw(st.integers(0, cap_l - 1))
    span_r, span_l = min(cap_r - base_r, 3 * n + 1), min(cap_l - base_l, 3 * n + 1)
    remote = draw(st.lists(st.integers(base_r, base_r + span_r - 1), min_size=n, max_size=n))
    local = draw(
        st.lists(
            st.integers(base_l, base_l + span_l - 1),
            min_size=min(n, span_l),
            max_size=min(n, span_l),
            unique=True,
        )
    )
    remote = remote[: len(local)]
    if local and draw(st.integers(0, 9)) == 0:  # break it
        i = draw(st.integers(0, len(local) - 1))
        which = draw(st.sampled_from(["dup", "high_r", "neg_l", "high_l"]))
        if which == "dup" and len(local) > 1:
            local[i] = local[i - 1]
        elif which == "high_r":
            remote[i] = cap_r
        elif which == "neg_l":
            local[i] = -1
        else:
            local[i] = cap_l + draw(st.integers(0, 5))
    return np.array(remote, dtype=np.int64), np.array(local, dtype=np.int64), cap_r, cap_l


@settings(max_examples=examples(500), deadline=None)
@given(reads())
def test_native_plan_equals_the_reference(case) -> None:
    remote, local, cap_r, cap_l = case
    loc, rem = layout(cap_l), layout(cap_r)
    want = outcome((remote, local), loc, rem, native=False)
    assert outcome((remote, local), loc, rem, native=True) == want
    if want[0] != "error":  # and the count is that of the merged runs
        runs = merge_runs(np.array(want[0], dtype=np.int64), np.array(want[1], dtype=np.int64))
        assert want[2] == len(runs)


def test_native_plan_is_stable_for_repeated_remote_pages() -> None:
    p = plan_pool_read("p", ([5, 3, 5, 3], [9, 8, 1, 0]), layout(10), layout(10), native=True)
    assert p.remote.tolist() == [3, 3, 5, 5] and p.local.tolist() == [8, 0, 9, 1]


def test_native_plan_takes_lists_tensors_and_strided_arrays() -> None:
    import torch

    strided = np.arange(20, dtype=np.int64)[::2]  # not contiguous
    for spec in [(list(strided), torch.arange(10)), (strided, np.arange(10, dtype=np.int32))]:
        p = plan_pool_read("p", spec, layout(32), layout(32), native=True)
        assert p.remote.tolist() == list(range(0, 20, 2)) and p.descriptors == 10


def test_native_plan_refuses_bad_buffers_and_capacities() -> None:
    assert PLAN is not None
    r = np.arange(4, dtype=np.int64)
    out = np.empty(4, dtype=np.int32)
    with pytest.raises(TypeError):
        PLAN.order(r.astype(np.int32), r, 4, 4, out, out.copy())  # int32 inputs
    with pytest.raises(TypeError):
        PLAN.order(r, r, 4, 4, out.astype(np.int64), out)  # int64 outputs
    with pytest.raises(TypeError):
        PLAN.order(r, r, 4, 4, out, np.empty((2, 2), dtype=np.int32))  # 2-d
    with pytest.raises(BufferError):
        PLAN.order(r, r, 4, 4, bytes(16), out)  # read-only output
    with pytest.raises(ValueError):
        PLAN.order(r, r[:3], 4, 4, out, out.copy())  # lengths differ
    with pytest.raises(ValueError):
        PLAN.order(r, r, 0, 4, out, out.copy())  # no pages
    with pytest.raises(ValueError):
        PLAN.order(r, r, (1 << 31) + 1, 4, out, out.copy())  # past int32 indices
    with pytest.raises(TypeError):
        PLAN.order(r, r, 4, 4, out)  # five arguments
    assert PLAN.order(r, r, 4, 4, out, out.copy()) == 1
