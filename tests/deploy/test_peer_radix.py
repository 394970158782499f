"""SGLang's radix cache as a benchmark peer. The first run installs it (about a minute, 1.5 GB)."""

import pytest

from benchmarks.peers import PeerUnavailable, ensure_sglang, run_sglang_radix


@pytest.fixture(scope="module")
def sglang():
    try:
        return ensure_sglang()
    except PeerUnavailable as e:
        pytest.skip(f"SGLang peer not installable here: {e}")


# Each run starts a worker that imports SGLang (several seconds), so the cases double up.
@pytest.mark.parametrize("page_size,gc_mode", [(4, "default"), (1, "freeze")])
def test_match_lengths_are_sane(sglang, page_size, gc_mode):
    base = list(range(100, 110))  # 10 tokens
    sequences = [
        base,
        base,  # identical: matches fully, page-aligned
        base[:6] + [7, 7, 7, 7],  # shares 6 tokens
        [1, 2, 3],  # unrelated
        base + [50, 51],  # extends the first
    ]
    run = run_sglang_radix(sequences, page_size, gc_mode=gc_mode)

    def aligned(n):
        return n // page_size * page_size

    assert run.match_lengths == (0, aligned(10), aligned(6), 0, aligned(10))
    assert all(m % page_size == 0 for m in run.match_lengths)
    assert run.requests == len(sequences) and run.elapsed_s > 0 and run.ops_per_s > 0
    assert run.page_size == page_size and run.gc_mode == gc_mode


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        run_sglang_radix([[1, 2]], 0)
    with pytest.raises(ValueError):
        run_sglang_radix([[1, 2]], 4, gc_mode="off")
    with pytest.raises(ValueError, match="sequence 0"):
        run_sglang_radix([[2**63]], 1)
