"""The native page keys (core/cache/csrc/) against the pure-Python reference: the same
packed bytes, keys and errors for any input; BLAKE2b itself against hashlib; the
KVF_NATIVE switch. Under KVF_NATIVE=0 the comparisons are skipped (the reference runs
alone); otherwise the extension must have loaded: a build that failed fails here."""

import hashlib
import os
import subprocess
import sys
from array import array
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.cache import keys, native, radix
from kvfabric.core.cache.keys import KeyError_, PageKeyer, pack_py
from kvfabric.core.index import presence

ROOT = Path(__file__).resolve().parents[2]
I32 = (-(2**31), 2**31 - 1)
needs_native = pytest.mark.skipif(
    native.MODE is native.Mode.OFF, reason="KVF_NATIVE=0: the reference alone"
)


def outcome(f, *args):
    """What a call gives: its value, or its error's type and message."""
    try:
        return ("ok", f(*args))
    except Exception as e:  # any type: the two paths must raise the same one
        return ("error", type(e), str(e))


@needs_native
def test_the_extensions_loaded():
    assert native.ENABLED and keys.EXT is not None, "the native keys did not load: rebuild them"
    assert presence.ENABLED, "the native index core did not load: rebuild it"
    assert radix.ENABLED, "the native radix tree did not load: rebuild it"


# --- BLAKE2b ------------------------------------------------------------------------------


@needs_native
def test_blake2b_matches_hashlib_across_block_edges():
    ext = keys.EXT
    for n in [*range(0, 300), 383, 384, 385, 1023, 1024, 1025, 4096]:
        data = hashlib.sha512(n.to_bytes(4, "little")).digest() * (n // 64 + 1)
        data = data[:n]
        for key in (b"", b"k", bytes(range(32)), bytes(range(64))):
            for size in (1, 16, 32, 64):
                want = hashlib.blake2b(data, key=key, digest_size=size).digest()
                assert ext.blake2b(data, key, size) == want, (n, len(key), size)


@needs_native
@given(st.binary(max_size=2000), st.binary(max_size=64), st.integers(1, 64))
def test_blake2b_matches_hashlib(data, key, size):
    assert (
        keys.EXT.blake2b(data, key, size)
        == hashlib.blake2b(data, key=key, digest_size=size).digest()
    )


@needs_native
@pytest.mark.parametrize(
    "args",
    [
        (b"x", b"k" * 65, 16),
        (b"x", b"", 0),
        (b"x", b"", 65),
        (b"x", "k", 16),
        ("text", b"", 16),
        (b"x", b"", 1.0),
    ],
)
def test_blake2b_rejects_bad_arguments(args):
    with pytest.raises((ValueError, TypeError)):
        keys.EXT.blake2b(*args)


# --- packing and keys: native against the reference ------------------------------------

ints = st.one_of(st.integers(*I32), st.sampled_from([*I32, 0, -1]))
bad_items = st.one_of(
    st.integers(2**31, 2**70),
    st.integers(-(2**70), -(2**31) - 1),
    st.floats(allow_nan=False),
    st.text(max_size=2),
    st.none(),
    st.just(True),
    st.just(np.int64(7)),
    st.just(np.int64(2**40)),
    st.just(np.float32(1.0)),
)
token_lists = st.one_of(
    st.lists(ints, max_size=90), st.lists(st.one_of(ints, bad_items), max_size=40)
)


def containers(values):
    """The same token ids as the containers callers pass."""
    out = [list(values), tuple(values)]
    if all(type(v) is int and I32[0] <= v <= I32[1] for v in values):
        out += [
            array("i", values),
            array("q", values),
            np.array(values, dtype=np.int64),
            np.array(values, dtype=np.int32),
            np.array(values + values, dtype=np.int64)[::2],
            range(len(values)),
        ]
        if all(-(2**15) <= v < 2**15 for v in values):
            out.append(np.array(values, dtype=np.int16))
            if all(-128 <= v < 128 for v in values):
                out.append(array("b", values))
        if all(v >= 0 for v in values):
            out += [np.array(values, dtype=np.uint64), array("Q", values)]
            if all(v < 2**16 for v in values):
                out.append(np.array(values, dtype=np.uint16))
            if all(v < 256 for v in values):
                out.append(bytes(values))
    elif all(type(v) is int for v in values):  # out of int32: typed buffers that hold them
        if all(-(2**63) <= v < 2**63 for v in values):
            out += [array("q", values), np.array(values, dtype=np.int64)]
        if all(0 <= v < 2**64 for v in values):
            out.append(np.array(values, dtype=np.uint64))
    return out


@needs_native
@given(token_lists)
def test_pack_matches_the_reference(values):
    for tokens in containers(values):
        got, want = outcome(keys.EXT.pack, tokens), outcome(pack_py, tokens)
        assert got == want, type(tokens)
        assert outcome(keys.encode_tokens, tokens) == want


@needs_native
@given(token_lists, st.lists(ints, max_size=90), st.integers(0, 2))
def test_packs_to_agrees_with_packing(values, others, edit):
    """equal(tokens, raw) is pack(tokens) == raw, on raws of the same tokens, of other
    tokens and of the same ones with one changed, dropped or added. Tokens that cannot be
    packed give pack's error, or False where they differ from raw before the bad one."""
    for tokens in containers(values):
        want = outcome(pack_py, tokens)
        packed = want[1] if want[0] == "ok" else None
        raws = [pack_py(others)]
        if packed:
            raws += [
                packed,
                packed[:-4],
                packed + packed[:4],
                packed[:-1] + bytes([packed[-1] ^ 1]),
            ]
        for raw in raws:
            expect = [("ok", packed == raw)] if packed is not None else [want, ("ok", False)]
            assert outcome(keys.EXT.equal, tokens, raw) in expect, (type(tokens), raw)
            assert outcome(keys.packs_to, tokens, raw) in expect


OUTSIDE_INT32 = [2**31, -(2**31) - 1, 2**40, -(2**63), 2**63 - 1, 2**32 + 5]


@needs_native
@given(
    st.lists(st.integers(*I32), min_size=1, max_size=1200),
    st.data(),
)
def test_long_int64_arrays_pack_and_compare_as_lists_do(values, data):
    """int64 arrays are read in one pass without a branch per token (as 32-bit halves), then
    one by one only where that pass found something: one token outside int32 or one
    differing from raw, anywhere, gives what packing gives: the first token outside int32
    raises, unless one before it differs from raw (False). The raw holds the bad token's
    low half, so only its range can tell."""
    n = len(values)
    bad = data.draw(st.none() | st.integers(0, n - 1), label="bad")
    differs = data.draw(st.none() | st.integers(0, n - 1), label="differs")
    tokens = list(values)
    if bad is not None:
        tokens[bad] = data.draw(st.sampled_from(OUTSIDE_INT32), label="outside")
    other = list(values)
    if bad is not None:
        other[bad] = np.array(tokens[bad], dtype=np.int64).astype(np.int32).item()
    if differs is not None:
        other[differs] ^= 1
    raw = pack_py(other)
    want_raw = outcome(pack_py, tokens)
    if bad is not None and differs is not None and differs < bad:
        want_equal = ("ok", False)
    elif bad is not None:
        want_equal = want_raw
    else:
        want_equal = ("ok", differs is None)
    for held in (array("q", tokens), np.array(tokens, dtype=np.int64)):
        assert outcome(keys.EXT.pack, held) == want_raw
        assert outcome(keys.EXT.equal, held, raw) == want_equal
        assert outcome(keys.EXT.equal, held, raw + raw[:4]) == ("ok", False)  # lengths differ


@needs_native
@pytest.mark.parametrize(
    "tokens",
    [
        5,
        None,
        (t for t in [1]),
        "ab",
        1.5,
        np.zeros((2, 2), dtype=np.int64),
        np.array(3),
        np.array([1.0, 2.0]),
        memoryview(b"ab").cast("c"),
        np.array([True, False]),
        [[1]],
        {1: 2},
        {3},
        array("d", [1.0]),
        np.broadcast_to(np.int32(7), (3,)),
        np.array([1, 2], dtype=">i4"),
    ],
)
def test_pack_matches_the_reference_on_odd_inputs(tokens):
    assert outcome(keys.EXT.pack, tokens) == outcome(pack_py, tokens)


@needs_native
def test_pack_refuses_a_view_too_long_to_pack():
    """A broadcast view claims 2**62 tokens with no memory behind them: a MemoryError, not
    an overflowed size (the reference would iterate them all)."""
    with pytest.raises(MemoryError):
        keys.EXT.pack(np.broadcast_to(np.int8(1), (2**62,)))


prev_keys = st.one_of(
    st.none(),
    st.binary(min_size=16, max_size=16),
    st.binary(max_size=20),
    st.text(max_size=3),
    st.just(bytearray(16)),
)
first_pages = st.one_of(
    st.integers(0, 30), st.integers(-3, -1), st.just(True), st.just(2**70), st.just(1.0)
)


@needs_native
@given(
    token_lists,
    st.integers(1, 20),
    st.text(min_size=1, max_size=8),
    st.binary(max_size=32),
    prev_keys,
    first_pages,
)
def test_keys_match_the_reference(values, page, namespace, fingerprint, prev, first):
    fast = PageKeyer(namespace, fingerprint, page, native=True)
    slow = PageKeyer(namespace, fingerprint, page, native=False)
    assert fast.root == slow.root
    for tokens in containers(values):
        want = outcome(slow.pack, tokens, prev, first)
        assert outcome(fast.pack, tokens, prev, first) == want
        assert outcome(fast.keys, tokens, prev) == outcome(slow.keys, tokens, prev)
        if want[0] == "ok":
            raw, page_keys = want[1]
            assert raw == pack_py(tokens)
            assert len(page_keys) == max(0, len(values) // page - first)
            assert (
                fast.chain(raw, prev, first)
                == slow.chain(memoryview(raw), prev, first)
                == page_keys
            )


@needs_native
@given(st.lists(st.integers(*I32), max_size=60), st.integers(1, 8), st.integers(0, 12))
def test_chain_continues_a_prefix(values, page, first):
    """Keys from first_page on, chained from the key before it, are the tail of all keys."""
    for native_path in (True, False):
        k = PageKeyer("ns", b"fp", page, native=native_path)
        raw, every = k.pack(values)
        prev = every[first - 1] if 0 < first <= len(every) else None
        if prev is not None or first == 0:
            assert k.chain(raw, prev, first) == every[first:]


@needs_native
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(*I32), max_size=12)), max_size=8))
def test_chains_agree_with_keys_taking_turns(calls):
    """The native path keeps the last key's keyed state: keys taking turns (two differing
    in length only: the key length is hashed too) chain as hashlib does."""
    key_bytes = (b"k", b"k\0", bytes(range(32)))
    prev = bytes(16)
    for which, values in calls:
        key, raw = key_bytes[which], pack_py(values)
        want, last = [], prev
        for off in range(0, len(raw) - 7, 8):  # pages of 2 tokens
            last = hashlib.blake2b(last + raw[off : off + 8], key=key, digest_size=16).digest()
            want.append(last)
        assert keys.EXT.chain(raw, key, prev, 0, 2) == want


@needs_native
@pytest.mark.parametrize(
    "raw",
    [
        "text",
        [1, 2, 3, 4],
        7,
        None,
        memoryview(bytes(32))[::2],
        np.zeros((4, 4), dtype=np.int32),
        array("i", [1, 2, 3, 4]),
    ],
)
def test_chain_matches_the_reference_on_odd_raw(raw):
    fast, slow = (PageKeyer("ns", b"fp", 2, native=n) for n in (True, False))
    assert outcome(fast.chain, raw) == outcome(slow.chain, raw)


@pytest.mark.parametrize("page", [0, -1, True, 1.0, 2**20 + 1, "4"])
def test_keyer_rejects_bad_page_sizes(page):
    with pytest.raises(KeyError_, match="page_size"):
        PageKeyer("ns", b"fp", page)


def test_keyer_rejects_a_bad_fingerprint():
    with pytest.raises(KeyError_, match="fingerprint"):
        PageKeyer("ns", "fp", 4)  # type: ignore[arg-type]


def test_keys_are_the_published_chain():
    """The scheme, spelled out with hashlib: whichever path is on gives these bytes."""
    k = PageKeyer("tenant", b"fp", 2)
    ns = hashlib.blake2b(b"tenant", digest_size=32, person=b"kvf-ns").digest()
    root = hashlib.blake2b(b"fp", key=ns, digest_size=16).digest()
    p0 = hashlib.blake2b(root + array("i", [1, 2]).tobytes(), key=ns, digest_size=16).digest()
    p1 = hashlib.blake2b(p0 + array("i", [3, -4]).tobytes(), key=ns, digest_size=16).digest()
    assert k.root == root and k.keys([1, 2, 3, -4, 5]) == [p0, p1]


# --- the switch ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, mode",
    [
        (None, native.Mode.AUTO),
        ("0", native.Mode.OFF),
        ("1", native.Mode.ON),
        ("auto", native.Mode.AUTO),
        (" AUTO ", native.Mode.AUTO),
    ],
)
def test_mode_from_the_environment(value, mode):
    assert native.mode_from(value) is mode


@pytest.mark.parametrize("value", ["", "yes", "2", "true", "native"])
def test_bad_modes_are_rejected(value):
    with pytest.raises(ValueError, match="KVF_NATIVE must be one of 0, 1, auto"):
        native.mode_from(value)


PROBE = """
import sys, warnings
if sys.argv[1] == "block":                 # as if the extension was never built
    sys.modules["kvfabric.core.cache._pagekeys"] = None
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    from kvfabric.core.cache import keys, native
    import kvfabric.core.cache.keys      # a second import warns no more
k = keys.PageKeyer("ns", b"fp", 2)
assert k.keys([1, 2, 3, 4]) == keys.PageKeyer("ns", b"fp", 2, native=False).keys([1, 2, 3, 4])
print(native.MODE.value, native.ENABLED, len(seen), *(str(w.message) for w in seen), sep="|")
"""


def probe(mode: str | None, block: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVF_NATIVE"}
    if mode is not None:
        env["KVF_NATIVE"] = mode
    return subprocess.run(
        [sys.executable, "-c", PROBE, "block" if block else "-"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_native
@pytest.mark.parametrize(
    "mode, block, want",
    [
        (None, False, "auto|True|0"),
        ("1", False, "1|True|0"),
        ("0", False, "0|False|0"),
        ("0", True, "0|False|0"),
        ("auto", True, "auto|False|1|kvfabric: the native extension does not load"),
    ],
)
def test_the_switch(mode, block, want):
    out = probe(mode, block)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith(want), out.stdout


def test_the_switch_fails_loudly():
    forced = probe("1", block=True)
    assert (
        forced.returncode != 0
        and "KVF_NATIVE=1 but the native extension does not load" in forced.stderr
    )
    bad = probe("on")
    assert bad.returncode != 0 and "KVF_NATIVE must be one of 0, 1, auto, got 'on'" in bad.stderr
