"""Ours in a fresh interpreter: each timed run gets its own imports and GC history, and
its own KVF_NATIVE (the native path by default, or the pure-Python reference)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench_cpu() -> int:
    """The CPU every timed side of a bench is pinned to: the last this process may use (the
    same one for ours and the peer, so neither gets a quieter core)."""
    return max(os.sched_getaffinity(0))


def pin(cpu: int) -> None:
    """Run this process, and the threads it starts from now on, on one CPU (-1: leave it be).
    A peer that hands each call to a thread of its own pays a wake-up on another core
    otherwise, and ours pays none: pinning both measures the work, not the hop."""
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})


def run_worker(module: str, args: list, python: bool = False) -> dict:
    """`module.ours_worker(*args)` in a fresh process (args and result as JSON)."""
    env = {k: v for k, v in os.environ.items() if k != "KVF_NATIVE"}
    if python:
        env["KVF_NATIVE"] = "0"
    with tempfile.TemporaryDirectory(prefix="kvf-bench-") as tmp:
        out = Path(tmp) / "out.json"
        code = (
            f"import json, sys; from {module} import ours_worker; "
            "json.dump(ours_worker(*json.loads(sys.argv[1])), open(sys.argv[2], 'w'))"
        )
        cmd = [sys.executable, "-c", code, json.dumps(args), str(out)]
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        return json.loads(out.read_text())
