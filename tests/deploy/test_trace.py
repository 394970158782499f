import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.deploy.sim import trace
from kvfabric.deploy.sim.trace import TraceError, TraceRequest, load_trace, request_tokens

GOOD = {"timestamp": 5, "input_length": 1000, "output_length": 7, "hash_ids": [0, 1]}


def test_packaged_trace_loads():
    reqs = load_trace()
    assert len(reqs) == 12_031
    assert all(isinstance(r, TraceRequest) and isinstance(r.hash_ids, tuple) for r in reqs)
    assert reqs[0] == TraceRequest(0, 6758, 500, tuple(range(14)))
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(reqs, reqs[1:]))
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in reqs)
    assert {r.hash_ids[0] for r in reqs} == {0}  # README: every request shares its first block


def test_limit_reads_a_prefix():
    assert load_trace(limit=3) == load_trace()[:3]
    assert load_trace(limit=0) == []
    with pytest.raises(ValueError):
        load_trace(limit=-1)


def test_first_3000_requests_expand_to_their_lengths():
    reqs = load_trace(limit=3000)
    trace._block_caches.clear()
    seqs = [request_tokens(r) for r in reqs]
    assert sum(map(len, seqs)) == sum(-(-r.input_length * 32 // 512) for r in reqs)
    trace._block_caches.clear()
    assert [request_tokens(r) for r in reqs[:50]] == seqs[:50]  # deterministic, not cache state


def write(tmp_path, lines, name="bad.jsonl"):
    path = tmp_path / name
    path.write_text(
        "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines)
    )
    return path


BAD_LINES = {
    "invalid JSON": '{"timestamp": 1,\n',
    "expected a JSON object": [1, 2],
    "missing field(s): hash_ids": {k: v for k, v in GOOD.items() if k != "hash_ids"},
    "unknown field(s): extra": GOOD | {"extra": 1},
    "timestamp must be an integer": GOOD | {"timestamp": "5"},
    "input_length must be an integer": GOOD | {"input_length": 1000.0},
    "output_length must be an integer": GOOD | {"output_length": True},
    "timestamp must be >= 0": GOOD | {"timestamp": -1},
    "input_length must be >= 1": GOOD | {"input_length": 0, "hash_ids": []},
    "output_length must be >= 0": GOOD | {"output_length": -3},
    "hash_ids must be a list": GOOD | {"hash_ids": "0,1"},
    "hash_ids[1] must be an integer": GOOD | {"hash_ids": [0, False]},
    "hash_ids[0] must be >= 0": GOOD | {"hash_ids": [-1, 2]},
    "hash_ids has 3 block(s)": GOOD | {"hash_ids": [0, 1, 2]},
    "hash_ids has 1 block(s)": GOOD | {"hash_ids": [0]},
    "smaller than the previous one": GOOD | {"timestamp": 4},
}


@pytest.mark.parametrize("reason", BAD_LINES)
def test_bad_line_names_file_and_line(tmp_path, reason):
    path = write(tmp_path, [GOOD, BAD_LINES[reason], GOOD | {"timestamp": 9}])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value).startswith("bad.jsonl:2: ")
    assert reason in str(info.value)
    assert (info.value.path, info.value.line) == (path, 2)


def test_error_line_counts_blank_lines(tmp_path):
    path = write(tmp_path, [GOOD, "\n", GOOD | {"output_length": -1}])
    with pytest.raises(TraceError, match=r"^bad\.jsonl:3: output_length"):
        load_trace(path)


def test_options(tmp_path):
    path = write(tmp_path, [GOOD, "  \n", GOOD | {"timestamp": 1}], name="t.jsonl")
    assert [r.timestamp_ms for r in load_trace(path, require_ordered=False)] == [5, 1]
    assert len(load_trace(path, limit=1)) == 1  # stops before the out-of-order line
    small = write(tmp_path, [GOOD | {"hash_ids": [0, 1, 2, 3]}], name="small.jsonl")
    assert load_trace(small, block_tokens=256)[0].hash_ids == (0, 1, 2, 3)
    with pytest.raises(TraceError, match="ceil"):
        load_trace(small)
    with pytest.raises(ValueError):
        load_trace(small, block_tokens=0)


def requests(max_blocks=6):
    @st.composite
    def build(draw):
        hash_ids = draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=max_blocks))
        block_tokens = draw(st.sampled_from([16, 64, 512]))
        n = len(hash_ids)
        input_length = draw(st.integers((n - 1) * block_tokens + 1, n * block_tokens))
        return TraceRequest(0, input_length, 0, tuple(hash_ids)), block_tokens

    return build()


@given(requests(), st.integers(1, 64))
def test_request_tokens_length_and_vocab(req_bt, tokens_per_block):
    req, block_tokens = req_bt
    tokens = request_tokens(req, tokens_per_block, block_tokens)
    assert len(tokens) == math.ceil(req.input_length * tokens_per_block / block_tokens)
    assert len(tokens) > (len(req.hash_ids) - 1) * tokens_per_block  # last block not empty
    assert all(isinstance(t, int) and 0 <= t < 32_000 for t in tokens)


@given(st.lists(st.integers(0, 2**40), min_size=2, max_size=8), st.integers(1, 64))
def test_equal_ids_give_equal_blocks(hash_ids, tokens_per_block):
    bt = 512
    req = TraceRequest(0, len(hash_ids) * bt, 0, tuple(hash_ids))
    tokens = request_tokens(req, tokens_per_block, bt)
    blocks = [
        tuple(tokens[i * tokens_per_block : (i + 1) * tokens_per_block])
        for i in range(len(hash_ids))
    ]
    for i, a in enumerate(hash_ids):
        for j, b in enumerate(hash_ids):
            if a == b:
                assert blocks[i] == blocks[j]
            elif tokens_per_block >= 8:  # collision odds 32000**-8
                assert blocks[i] != blocks[j]


@given(
    st.lists(st.integers(0, 1000), min_size=1, max_size=5),
    st.lists(st.integers(0, 1000), min_size=1, max_size=5),
    st.lists(st.integers(0, 1000), min_size=1, max_size=5),
)
def test_shared_hash_prefix_gives_shared_token_prefix(prefix, tail_a, tail_b):
    a = TraceRequest(0, 512 * len(prefix + tail_a), 0, tuple(prefix + tail_a))
    b = TraceRequest(0, 512 * len(prefix + tail_b) - 100, 0, tuple(prefix + tail_b))
    n = 16 * len(prefix)
    assert request_tokens(a, 16)[:n] == request_tokens(b, 16)[:n]


def test_request_tokens_rejects_bad_arguments():
    req = TraceRequest(0, 600, 0, (1, 2))
    for kwargs in ({"tokens_per_block": 0}, {"block_tokens": 0}, {"vocab_size": 0}):
        with pytest.raises(ValueError):
            request_tokens(req, **kwargs)
    with pytest.raises(ValueError, match="inconsistent"):
        request_tokens(TraceRequest(0, 600, 0, (1,)))
    assert max(request_tokens(req, 32, vocab_size=7)) < 7
