"""Every `kvfabric bench` subcommand runs as a user runs it: through the entry point, from
a folder outside the checkout (the transport bench's NIXL peer once failed there: a
spawned process could not import `benchmarks`), at a tiny size, ending with its JSON line.
Not figures: the sizes are too small to mean anything. The native peers (SGLang's caches for
radix, Dynamo's indexer for index) are installed from PyPI at first use (benchmarks/peers.py);
where the registry can't be reached (PeerUnavailable) their runs are skipped, saying so. Left
to its own runs: tp-drift's two vLLM engines (minutes to start; here its options only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import peers

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


def need(ensure) -> None:
    """Install a native peer (once per machine), or skip when the registry is unreachable."""
    try:
        ensure()
    except peers.PeerUnavailable as e:
        pytest.skip(f"the native peer can't be installed here: {e}")


def _may_read_other_processes() -> bool:
    """Whether process_vm_readv of a child works here: Yama absent, or its ptrace_scope
    lets a parent read its descendants (0 or 1)."""
    try:
        return Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip() in ("0", "1")
    except FileNotFoundError:
        return True


@pytest.mark.parametrize(
    "args, name",
    [
        (["transport", "--quick", "--no-object-store", "--json"], "transport"),
        (
            ["index", "--scale", "--conversations", "20", "--slots", "8", "40", "--python"]
            + ["--repeat", "1", "--json"],
            "index-scale",
        ),
        (["radix", "--capacity", "0.5", "--requests", "20", "--repeat", "1", "--json"], None),
        (["staging", "--tokens", "2048", "--repeat", "2", "--json"], "staging"),
        (["disk", "--pages", "8", "--batch", "3", "--repeat", "1", "--json"], "disk"),
    ],
)
def test_each_bench_runs_from_outside_the_checkout(args, name, tmp_path):
    result = bench(args, tmp_path)
    assert result["name"] == (name or "radix-eviction"), result
    if name == "index-scale":  # a row per slot count, both cores, the ratios of the last
        assert (
            [r["slots"] for r in result["rows"]]
            == [8, 40]
            == [r["slots"] for r in result["python_rows"]]
        )
        assert all(r["cached_pages"] >= r["held_keys"] > 0 for r in result["rows"])
        assert result["bytes_per_page_ratio_40_vs_8"] > 0 and result["lookup_ratio_40_vs_8"] > 0
    if name == "transport":
        rows = {(r["page_bytes"], r["pages"]): r for r in result["rows"]}
        assert set(rows) == {(64 << 10, 64), (4 << 10, 1024)}
        for row in rows.values():
            assert row["nixl_gbps"] > 0 and row["memcpy_gbps"] >= row["page_copy_gbps"] > 0
        assert result["ratio_vs_page_copy_64k"] > 0 and result["ratio_vs_page_copy_4k"] > 0
        if result["device"] == "cpu" and _may_read_other_processes():
            assert all(row["cma_limit_gbps"] > 0 for row in rows.values())
            assert result["ratio_vs_cma_limit_64k"] > 0 and result["ratio_vs_cma_limit_4k"] > 0
    if name == "staging":
        assert result["tokens"] == 2048 and result["ratio_vs_memcpy"] > 0
        assert result["save_ratio_vs_memcpy"] > 0 and result["host_ratio_vs_memcpy"] > 0
    if name == "disk":  # both page files measured, the bench's files gone again
        assert result["ratio_read"] > 0 and result["ratio_write"] > 0
        assert [r["page_file"] for r in result["rows"]] == ["posix", "nixl"]
        keys = ("write_gbps", "read_gbps", "plain_write_gbps", "plain_read_gbps")
        assert all(r[k] > 0 for r in result["rows"] for k in keys)
        assert result["page_bytes"] == 256 << 10 and result["checksum_gbps"] > 0
        assert list(tmp_path.iterdir()) == []


def test_index_bench_runs_against_dynamo(tmp_path):
    need(peers.ensure_dynamo)
    result = bench(["index", "--requests", "20", "--repeat", "1", "--json"], tmp_path)
    assert result["name"] == "index", result
    # Dynamo routed every round as ours did (the bench raises otherwise), and was timed.
    assert result["dynamo_rounds_per_s"] > 0 and result["dynamo_hashing_rounds_per_s"] > 0
    assert result["ratio_vs_dynamo"] > 0 and result["ratio_vs_dynamo_hashing"] > 0


def test_radix_bench_runs_against_sglangs_caches(tmp_path):
    need(peers.ensure_sglang)
    args = ["radix", "--requests", "20", "--repeat", "1", "--gc", "collect", "--json"]
    result = bench(args, tmp_path, timeout_s=600)
    assert result["name"] == "radix", result
    # Every SGLang cache matched what ours matched on every request (the bench raises
    # otherwise); each was timed.
    assert result["ours_matched_tokens"] == result["peer_matched_tokens"] > 0
    for key in ("peer_ops_per_s", "unified_ops_per_s", "rust_binding_ops_per_s"):
        assert result[key] > 0, key
    assert result["ratio_vs_sglang_unified"] > 0 and result["ratio_vs_sglang_rust_binding"] > 0


def test_connector_bench_runs_a_real_engine_with_and_without_the_fabric(tmp_path):
    pytest.importorskip("vllm")
    args = ["connector", "--tokens", "256", "--decoders", "2", "--stall-tokens", "64"]
    args += ["--stall-s", "0.5", "--repeat", "1", "--decode-runs", "2", "--save-runs", "2"]
    args += ["--json"]
    result = bench(args, tmp_path, timeout_s=900)
    assert result["name"] == "connector", result
    # Each fabric hit loaded the whole cached prompt (the bench raises otherwise), and so
    # did the request whose node was stopped as it asked.
    assert result["stalled_request_hit"] is True
    for key in (
        "ttft_ratio_vs_device_hit",
        "worker_load_ratio_vs_memcpy",
        "worker_load_cpu_ratio_vs_memcpy",
        "worker_save_ratio_vs_memcpy",
        "worker_save_cpu_ratio_vs_memcpy",
        "node_load_ratio_vs_memcpy",
    ):
        assert result[key] > 0, key
    assert (
        result["decode_ratio_vs_no_connector"] > 0 and result["decode_ratio_with_stalled_load"] > 0
    )


def test_every_bench_is_covered_here_or_lists_its_options(tmp_path):
    from kvfabric.deploy.cli.main import BENCHES

    assert set(BENCHES) == {
        "transport",
        "index",
        "radix",
        "tp-drift",
        "staging",
        "connector",
        "disk",
    }
    out = subprocess.run(
        [KVFABRIC, "bench", "tp-drift", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "--json" in out.stdout, out.stderr
