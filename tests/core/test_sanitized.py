"""`make sanitize` checks itself: the extensions it tests are the ones it built with ASan
and UBSan, and a read past a heap buffer does abort the process there. Without this, a
build that silently dropped the flags would pass the sanitized run unchecked. Skipped
outside that run (KVF_SANITIZE unset)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("KVF_SANITIZE") != "1", reason="only under `make sanitize`"
)


def test_the_extensions_under_test_are_the_sanitized_build():
    from kvfabric.core.cache import _copy, _crc32c, _radix, radix  # type: ignore[attr-defined]
    from kvfabric.core.index import _presence
    from kvfabric.transport import _plan  # type: ignore[attr-defined]  # built C

    assert radix.ENABLED
    here = Path.cwd().resolve()
    for module in (_radix, _presence, _plan, _copy, _crc32c):
        path = Path(module.__file__).resolve()
        assert here in path.parents, path
        assert b"__asan_report" in path.read_bytes(), f"{path} built without ASan"
        assert b"__ubsan_handle" in path.read_bytes(), f"{path} built without UBSan"


def test_a_heap_overflow_aborts_the_process():
    """A child reads 16 bytes past a 16-byte buffer: ASan stops it with a report."""
    code = "import ctypes; b = ctypes.create_string_buffer(16); ctypes.string_at(b, 32)"
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert child.returncode != 0
    assert "AddressSanitizer" in child.stderr, child.stderr[-2000:]
