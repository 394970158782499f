"""The C extensions' sources are clang-format clean under the repository's .clang-format
(CPython's PEP 7 spirit): a C change is formatted before it lands, as ruff does for Python."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(
    path
    for folder in ("core/cache/csrc", "core/index/csrc", "transport/csrc")
    for path in (ROOT / folder).glob("*.[ch]")
)


def _clang_format() -> str | None:
    """The test extra's clang-format (beside this interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / "clang-format"
    return str(beside) if beside.exists() else shutil.which("clang-format")


def test_the_c_sources_are_found():
    assert len(SOURCES) >= 20 and (ROOT / ".clang-format").is_file()


@pytest.mark.skipif(
    _clang_format() is None,
    reason="clang-format is not installed (the test extra pins it: pip install -e '.[test]')",
)
@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_c_source_is_clang_format_clean(path: Path):
    run = subprocess.run(
        [_clang_format(), "--dry-run", "--Werror", f"--style=file:{ROOT / '.clang-format'}", path],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"run `clang-format -i {path.relative_to(ROOT)}`:\n{run.stderr}"
