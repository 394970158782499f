"""Every `kvfabric bench` subcommand runs as a user runs it: through the entry point, from
a folder outside the checkout (the transport bench's NIXL peer once failed there: a
spawned process could not import `benchmarks`), at a tiny size, ending with its JSON line.
Not figures: the sizes are too small to mean anything. Two parts are left to their own
runs: radix's SGLang peer (installed from PyPI at first use; here `--capacity` runs ours
alone) and tp-drift's two vLLM engines (minutes to start; here its options only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KVFABRIC = str(Path(sys.executable).parent / "kvfabric")


def bench(args: list[str], cwd: Path, timeout_s: float = 300) -> dict:
    out = subprocess.run(
        [KVFABRIC, "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONPATH": ""},  # nothing but what the entry point finds
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "args, name",
    [
        (["transport", "--quick", "--no-object-store", "--json"], "transport"),
        (["index", "--requests", "20", "--repeat", "1", "--json"], "index"),
        (["radix", "--capacity", "0.5", "--requests", "20", "--repeat", "1", "--json"], None),
        (["staging", "--tokens", "2048", "--repeat", "2", "--json"], "staging"),
    ],
)
def test_each_bench_runs_from_outside_the_checkout(args, name, tmp_path):
    result = bench(args, tmp_path)
    assert result["name"] == (name or "radix-eviction"), result
    if name == "transport":
        (row,) = result["rows"]
        assert row["nixl_gbps"] > 0 and row["memcpy_gbps"] > 0
    if name == "staging":
        assert result["tokens"] == 2048 and result["ratio_vs_memcpy"] > 0
        assert result["save_ratio_vs_memcpy"] > 0


def test_every_bench_is_covered_here_or_lists_its_options(tmp_path):
    from kvfabric.deploy.cli.main import BENCHES

    assert set(BENCHES) == {"transport", "index", "radix", "tp-drift", "staging"}
    out = subprocess.run(
        [KVFABRIC, "bench", "tp-drift", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "--json" in out.stdout, out.stderr
