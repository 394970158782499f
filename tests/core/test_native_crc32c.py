"""The CRC-32C kernel (core/cache/csrc/crc32c.c) against a pure-Python bit-by-bit
reference and RFC 3720's check values: the same value for every length and alignment
(its three-stream blocks of 3 x 8192 and 3 x 256 bytes, the single stream, the bytes
around them), with and without the CPU's instruction, continued across calls as
zlib.crc32 is; and a clear error for every bad argument. read_checks, what the disk store
checks reads against, gives the kernel's value of each page on either core."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.core.cache import disk_records

from tests.examples import examples

crc32c_module = disk_records._CRC32C
pytestmark = pytest.mark.skipif(
    crc32c_module is None, reason="KVF_NATIVE=0 or not built: zlib's CRC-32 alone"
)

POLY = 0x82F63B78  # Castagnoli, bit-reversed


def reference(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (POLY if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def kernels():
    return [crc32c_module.crc32c, crc32c_module.portable]


def test_rfc_3720_check_values():
    cases = {
        b"123456789": 0xE3069283,
        bytes(32): 0x8A9136AA,
        b"\xff" * 32: 0x62A8AB43,
        bytes(range(32)): 0x46DD794E,
        bytes(range(31, -1, -1)): 0x113FDB5C,
        b"": 0,
    }
    for data, want in cases.items():
        assert reference(data) == want
        for kernel in kernels():
            assert kernel(data) == want, (kernel.__name__, data[:8])


# The lengths where the kernel changes path: its alignment prologue, the 3 x 256 and
# 3 x 8192 blocks, the 8-byte words and the tail.
EDGES = [0, 1, 7, 8, 9, 767, 768, 769, 775, 24575, 24576, 24577, 25343, 25344, 25352, 49153]


@settings(max_examples=examples(60), deadline=None)
@given(
    length=st.one_of(st.sampled_from(EDGES), st.integers(0, 4000)),
    offset=st.integers(0, 15),
    seed=st.integers(0, 2**32 - 1),
    start=st.integers(0, 2**32 - 1),
)
def test_every_length_and_alignment_matches_the_reference(length, offset, seed, start):
    raw = np.random.default_rng(seed).integers(0, 256, length + offset, np.uint8).tobytes()
    data = memoryview(raw)[offset:]  # any alignment of the first byte
    want = reference(bytes(data), start)
    for kernel in kernels():
        assert kernel(data, start) == want


@settings(max_examples=examples(60), deadline=None)
@given(data=st.binary(max_size=3000), cut=st.integers(0, 3000))
def test_a_crc_continues_across_calls(data, cut):
    cut = min(cut, len(data))
    for kernel in kernels():
        assert kernel(data[cut:], kernel(data[:cut])) == kernel(data)


def test_a_page_of_any_buffer_type():
    rows = np.random.default_rng(1).integers(0, 256, (3, 256 << 10), np.uint8)
    want = [crc32c_module.portable(r.tobytes()) for r in rows]
    assert [crc32c_module.crc32c(r) for r in rows] == want
    assert [crc32c_module.crc32c(bytearray(r.tobytes())) for r in rows] == want
    assert disk_records.read_checks(rows) == want
    assert reference(rows[0, :30000].tobytes()) == crc32c_module.crc32c(rows[0, :30000])


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((), TypeError, "takes 1 or 2 arguments"),
        ((b"a", 0, 0), TypeError, "takes 1 or 2 arguments"),
        (("text",), TypeError, "bytes-like object is required"),
        ((12,), TypeError, "bytes-like object is required"),
        ((b"a", -1), ValueError, r"crc must be in \[0, 2\*\*32\)"),
        ((b"a", 2**32), ValueError, r"crc must be in \[0, 2\*\*32\)"),
        ((b"a", 2**80), ValueError, r"crc must be in \[0, 2\*\*32\)"),
        ((b"a", 1.0), TypeError, "crc must be an int"),
        ((b"a", "1"), TypeError, "crc must be an int"),
        ((np.zeros((4, 4), np.uint8)[:, 1],), ValueError, "not C-contiguous"),
    ],
)
def test_a_bad_argument_is_refused_by_name(args, error, match):
    for kernel in kernels():
        with pytest.raises(error, match=match):
            kernel(*args)


def test_the_pure_python_core_checks_with_zlib(monkeypatch):
    """With the kernel off (KVF_NATIVE=0), a read is checked with zlib's CRC-32: the values
    differ from the kernel's, and never meet them (they stay in one process)."""
    rows = np.random.default_rng(2).integers(0, 256, (4, 1 << 19), np.uint8)
    monkeypatch.setattr(disk_records, "_CRC32C", None)
    assert disk_records.read_checks(rows) == [zlib.crc32(r) for r in rows]
