"""mypy over the whole package (CHECKED), as the installed package names it. mypy does not
follow setuptools' editable finder, so the check runs over a tree of links that lays the
folders out as the wheel does."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("kvfabric",)


def test_the_package_type_checks(tmp_path):
    package = tmp_path / "kvfabric"
    package.mkdir()
    shutil.copy2(ROOT / "kvfabric" / "__init__.py", package / "__init__.py")
    for layer in ("core", "transport", "actors", "deploy"):
        os.symlink(ROOT / layer, package / layer)
    args = [arg for name in CHECKED for arg in ("-p", name)]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / ".mypy_cache"),
            *args,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
