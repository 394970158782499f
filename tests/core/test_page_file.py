"""Plain page files: pages land in their slots, bad arguments change nothing, a file
that is short or too big is handled at open, a full disk fails at open."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.cache.page_file import (
    DiskFull,
    PageGeometry,
    PosixPageFile,
    slot_runs,
)

GEOMETRY = PageGeometry((2, 3), torch.float32)  # 24 bytes a page


def pages(n: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(n * 6, dtype=torch.float32).reshape(n, 2, 3) + start


@given(slots=st.lists(st.integers(0, 15), unique=True, max_size=16))
def test_pages_land_in_their_slots(tmp_path_factory, slots):
    path = tmp_path_factory.mktemp("p") / "data"
    file = PosixPageFile(path, 16, GEOMETRY)
    written = pages(len(slots), 1.0)
    file.write(slots, written)
    data = path.read_bytes()
    for row, slot in enumerate(slots):
        at = slot * GEOMETRY.nbytes
        assert data[at : at + GEOMETRY.nbytes] == written[row].numpy().tobytes()
    out = torch.empty_like(written)
    file.read(slots, out)
    assert torch.equal(out, written)
    file.close()


def test_runs_batch_adjacent_slots_whatever_their_order():
    import numpy as np

    assert slot_runs(np.array([5, 3, 4, 9, 0])) == [(0, [4]), (3, [1, 2, 0]), (9, [3])]


@pytest.mark.parametrize(
    "slots, data, error",
    [
        ([0, 16], pages(2), "slot 16 out of range"),
        ([-1], pages(1), "slot -1 out of range"),
        ([1, 1], pages(2), "a slot appears twice"),
        ([True], pages(1), "slots must be a list of ints"),
        ([1.0], pages(1), "slots must be a list of ints"),
        ([1], pages(2), r"want pages torch.float32 \(1, 2, 3\)"),
        ([1], pages(1).double(), "want pages torch.float32"),
        ([1, 2], pages(4)[::2], "contiguous CPU tensor"),
        ([1], [[0.0]], "must be a torch.Tensor"),
    ],
)
def test_bad_arguments_change_nothing(tmp_path, slots, data, error):
    file = PosixPageFile(tmp_path / "data", 16, GEOMETRY)
    before = (tmp_path / "data").read_bytes()
    for op in (file.write, file.read):
        with pytest.raises(ValueError, match=error):
            op(slots, data)
    assert (tmp_path / "data").read_bytes() == before
    file.close()


def test_a_short_file_trusts_only_the_slots_it_held(tmp_path):
    path = tmp_path / "data"
    PosixPageFile(path, 16, GEOMETRY).close()
    with open(path, "r+b") as f:
        f.truncate(5 * GEOMETRY.nbytes + 7)
    file = PosixPageFile(path, 16, GEOMETRY)
    assert file.valid_slots == 5 and path.stat().st_size == 16 * GEOMETRY.nbytes
    file.close()
    smaller = PosixPageFile(path, 4, GEOMETRY)  # capacity shrank: the file follows
    assert smaller.valid_slots == 4 and path.stat().st_size == 4 * GEOMETRY.nbytes
    smaller.close()


def test_a_full_disk_fails_at_open_and_leaves_no_file(tmp_path):
    """posix_fallocate past the process's file size limit is a full disk in miniature."""
    code = textwrap.dedent(
        f"""
        import resource, signal, torch
        from pathlib import Path
        from kvfabric.core.cache.page_file import DiskFull, PageGeometry, PosixPageFile
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        path = Path({str(tmp_path / "data")!r})
        try:
            PosixPageFile(path, 1 << 20, PageGeometry((4,), torch.float32))
        except DiskFull as e:
            print("DiskFull:", e, path.exists())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("DiskFull: allocating 16777216 bytes for"), out.stdout
    assert out.stdout.strip().endswith("False")
    assert DiskFull.__mro__[1].__name__ == "PageFileError"
