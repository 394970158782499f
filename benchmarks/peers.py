"""Peers to benchmark against. Not runtime dependencies: each is installed on first use.

SGLang 0.5.23's prefix caches are the peers of the radix benchmark (``SglangCache``): its
default ``UnifiedRadixCache`` on the Rust TreeCore, that TreeCore's binding alone, and the
pure-Python ``RadixCache``, all in the ``sglang`` wheel. It is installed with
``pip install --target <cache>/sglang-0.5.23 --no-deps`` together with the packages it needs
at import time (never the GPU stack), and runs in a subprocess (``benchmarks/sglang_worker.py``)
that puts the folder *after* our own site-packages on ``sys.path``, so our torch and numpy are
the ones used and none of SGLang's import-time patches leak into the caller.

Dynamo's KV router indexer (``dynamo.llm.RadixTree``, Rust) is the native peer of the index
benchmark: the ``ai-dynamo-runtime`` wheel alone (abi3, no CUDA), installed the same way into
``<cache>/ai-dynamo-runtime-1.6.1`` and run by ``benchmarks/dynamo_worker.py``.

The cache root is ``$KVF_PEER_CACHE`` if set, else ``$XDG_CACHE_HOME/ray-kv-fabric/peers``
(``~/.cache/ray-kv-fabric/peers``).

Run ``python -m benchmarks.peers`` from the repository root for the trace figure.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from benchmarks.sglang_worker import pack_sequences, write_sequences

__all__ = [
    "DYNAMO_PACKAGES",
    "DYNAMO_VERSION",
    "DynamoRun",
    "SGLANG_PACKAGES",
    "SGLANG_VERSION",
    "PeerError",
    "PeerUnavailable",
    "RadixRun",
    "SglangCache",
    "dynamo_dir",
    "ensure_dynamo",
    "ensure_sglang",
    "peer_cache_root",
    "run_dynamo_rounds",
    "run_sglang_radix",
    "sglang_dir",
    "sglang_radix_ops_per_s",
]

SGLANG_VERSION = "0.5.23"

# Everything `import sglang.srt.mem_cache.radix_cache` needs beyond our venv (torch, numpy,
# pydantic, ...), each installed with --no-deps. Pinned to what was verified to import on CPU.
# torchvision is pinned to the release built for torch 2.13; see _tolerate_cpu_torchvision.
SGLANG_PACKAGES: tuple[str, ...] = (
    f"sglang=={SGLANG_VERSION}",
    "apache-tvm-ffi==0.1.15.post2",
    "compressed-tensors==0.20.1",
    "dill==0.4.1",
    "gguf==0.19.0",
    "httpcore2==2.16.2",
    "httpx2==2.16.2",
    "huggingface_hub==2.4.0",
    "ipython==9.18.1",
    "loguru==0.7.3",
    "msgspec==0.23.0",
    "orjson==3.13.0",
    "pillow==13.0.0",
    "psutil==7.2.2",
    "pybase64==1.5.1",
    "pyzmq==27.3.0",
    "regex==2026.11.19",
    "safetensors==0.8.0",
    "sentencepiece==0.2.3",
    "tokenizers==0.23.3",
    "torchvision==0.28.0",
    "tqdm==4.70.1",
    "traitlets==5.16.1",
    "transformers==5.25.0",
    "triton==3.9.0",
    "truststore==0.10.5",
)

# Dynamo's KV router indexer (dynamo.llm.RadixTree): the native peer of the index benchmark.
DYNAMO_VERSION = "1.6.1"
DYNAMO_PACKAGES: tuple[str, ...] = (f"ai-dynamo-runtime=={DYNAMO_VERSION}",)

_COMPLETE = ".kvf-complete"  # written last; holds the package list the folder was built from

# pip output meaning the registry (or the network to it) can't serve the packages here.
_UNAVAILABLE_MARKERS = (
    "No matching distribution found",
    "Could not find a version that satisfies",
    "NewConnectionError",
    "NameResolutionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Max retries exceeded",
    "ProxyError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "Could not fetch URL",
)


class PeerError(RuntimeError):
    """A peer could not be installed or run (for a reason other than an unreachable registry)."""


class PeerUnavailable(PeerError):
    """A peer cannot be installed here: the package registry or the network is unavailable."""


def _log(message: str) -> None:
    print(f"[kvf peers] {message}", file=sys.stderr, flush=True)


def peer_cache_root() -> Path:
    """Folder holding installed peers (``$KVF_PEER_CACHE`` overrides the default)."""
    override = os.environ.get("KVF_PEER_CACHE")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ray-kv-fabric" / "peers"


def sglang_dir() -> Path:
    return peer_cache_root() / f"sglang-{SGLANG_VERSION}"


@dataclass(frozen=True)
class _PeerInstall:
    """One peer's side folder: what goes in it, and how to check it works once it has."""

    label: str  # as messages name it
    folder: Path
    packages: tuple[str, ...]
    size: str  # what the user waits for, said once
    check: Callable[[Path], None]  # raises PeerError when the folder's peer does not work


def _is_complete(peer: _PeerInstall) -> bool:
    marker = peer.folder / _COMPLETE
    return marker.is_file() and marker.read_text().split() == list(peer.packages)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _pip_install(target: Path, packages: Sequence[str], label: str = "SGLang") -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--target",
        str(target),
        "--no-deps",
        *packages,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise PeerError(f"could not run pip ({cmd[0]}): {e}") from e
    if proc.returncode == 0:
        return
    output = proc.stdout + proc.stderr
    if "No module named pip" in output:
        raise PeerError(f"pip is not installed for {sys.executable}")
    if any(m in output for m in _UNAVAILABLE_MARKERS):
        raise PeerUnavailable(
            f"cannot install {label}: the package registry is unavailable "
            f"(pip exited {proc.returncode}):\n{_tail(output, 8)}"
        )
    raise PeerError(
        f"pip install of the {label} peer failed (exit {proc.returncode}):\n{_tail(output)}"
    )


def _ensure(peer: _PeerInstall, log: Callable[[str], None]) -> Path:
    """Return the peer's folder, installing it there first if needed.

    Safe against concurrent callers (file lock) and interrupted installs (the folder is built
    beside its final place, checked by importing the peer, then renamed).
    Raises PeerUnavailable when the registry can't be reached, PeerError on other failures.
    """
    folder = peer.folder
    if _is_complete(peer):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(peer):  # another process finished it while we waited
            return folder
        staging = folder.parent / f".{folder.name}.staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        log(
            f"installing the {peer.label} peer into {folder} "
            f"(once; {len(peer.packages)} packages, {peer.size}) ..."
        )
        start = time.perf_counter()
        try:
            _pip_install(staging, peer.packages, peer.label)
            peer.check(staging)
            (staging / _COMPLETE).write_text("\n".join(peer.packages) + "\n")
            shutil.rmtree(folder, ignore_errors=True)  # an outdated or broken earlier install
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log(f"installed the {peer.label} peer in {time.perf_counter() - start:.0f} s")
    return folder


def ensure_sglang(log: Callable[[str], None] = _log) -> Path:
    """Return the folder holding SGLang, installing it there first if needed (see _ensure)."""
    peer = _PeerInstall(
        f"SGLang {SGLANG_VERSION}",
        sglang_dir(),
        SGLANG_PACKAGES,
        "about 1.5 GB",
        lambda folder: _run_worker(["check", str(folder)]),
    )
    return _ensure(peer, log)


def dynamo_dir() -> Path:
    return peer_cache_root() / f"ai-dynamo-runtime-{DYNAMO_VERSION}"


def ensure_dynamo(log: Callable[[str], None] = _log) -> Path:
    """Return the folder holding Dynamo's runtime (its Rust KV indexer), installing it there
    first if needed (see _ensure). One abi3 wheel, no CUDA, no dependencies at import."""
    peer = _PeerInstall(
        f"Dynamo {DYNAMO_VERSION}",
        dynamo_dir(),
        DYNAMO_PACKAGES,
        "about 75 MB",
        lambda folder: _run_script("dynamo_worker.py", ["check", str(folder)], "Dynamo"),
    )
    return _ensure(peer, log)


class SglangCache(Enum):
    """Which of SGLang's prefix caches a run drives (the value is the worker's mode)."""

    UNIFIED = "unified"  # UnifiedRadixCache, SGLang's default, on its Rust TreeCore
    RUST_BINDING = "rust"  # that TreeCore's binding, called without the Python wrapper
    PYTHON = "radix"  # RadixCache, pure Python (the scheduler's simulated tree)

    @property
    def label(self) -> str:
        return {
            SglangCache.UNIFIED: "sglang.UnifiedRadixCache",
            SglangCache.RUST_BINDING: "sglang TreeCore binding",
            SglangCache.PYTHON: "sglang.RadixCache",
        }[self]


# default: the full collection imports owe lands in the timed loop; collect: it runs first;
# freeze: it runs first and the heap is then frozen out of the collector's reach.
GC_MODES = ("default", "collect", "freeze")


@dataclass(frozen=True)
class RadixRun:
    """One pass of one of SGLang's caches over a request sequence (match_prefix, then insert)."""

    page_size: int
    match_lengths: tuple[int, ...]  # cached prefix length SGLang reported for each request
    elapsed_s: float  # the match+insert loop only
    gc_mode: str = "default"  # collector state before the loop: see GC_MODES
    cache: SglangCache = SglangCache.PYTHON

    @property
    def requests(self) -> int:
        return len(self.match_lengths)

    @property
    def ops_per_s(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else float("inf")


def _run_script(script: str, args: list[str], label: str) -> None:
    # -I: don't put benchmarks/ (or $PYTHONPATH) ahead of our site-packages in the worker.
    cmd = [sys.executable, "-I", str(Path(__file__).resolve().parent / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PeerError(f"the {label} peer failed (exit {proc.returncode}):\n{_tail(proc.stderr)}")


def _run_worker(args: list[str]) -> None:
    _run_script("sglang_worker.py", args, "SGLang")


def run_sglang_radix(
    sequences: Sequence[Sequence[int]],
    page_size: int,
    *,
    gc_mode: str = "default",
    cache: SglangCache = SglangCache.PYTHON,
    cpu: int = -1,
) -> RadixRun:
    """Drive one of SGLang's caches: for each request match_prefix, then insert.

    Runs in a fresh worker process, one pass over a fresh tree, pinned to `cpu` (-1: not
    pinned). By default the garbage collector
    runs as in a stock SGLang scheduler; its full collections walk the whole heap SGLang's
    imports leave behind, which costs a single pass about 3x. ``collect`` runs the full
    collection the imports owe before the loop (steady state); ``freeze`` also moves that heap
    out of the collector's reach, as SGLang's ``freeze_gc`` (its /freeze_gc endpoint) does.
    """
    if gc_mode not in GC_MODES:
        raise ValueError(f"gc_mode must be one of {GC_MODES}, got {gc_mode!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not isinstance(cache, SglangCache):
        raise ValueError(f"cache must be a SglangCache, got {cache!r}")
    folder = ensure_sglang()

    def run(data: Path, result: Path) -> None:
        args = [str(folder), str(data), str(page_size), str(result), gc_mode, str(cpu)]
        _run_worker([cache.value, *args])

    out = _run_on_sequences(sequences, run)
    return RadixRun(
        page_size=page_size,
        match_lengths=tuple(out["match_lengths"]),
        elapsed_s=out["elapsed_s"],
        gc_mode=gc_mode,
        cache=cache,
    )


@dataclass(frozen=True)
class DynamoRun:
    """Dynamo's RadixTree over the index bench's rounds (see dynamo_worker.py)."""

    rounds_per_s: float  # events pre-built, block hashes given
    hashing_rounds_per_s: float  # compute_block_hash_for_seq inside the loop too
    answers: tuple[tuple[int, int], ...]  # per round: (worker routed to, pages it held)


def run_dynamo_rounds(
    sequences: Sequence[Sequence[int]], page: int, nodes: int, repeat: int, cpu: int = -1
) -> DynamoRun:
    """The best of `repeat` runs of Dynamo's indexer on the rounds, each on a fresh tree, in a
    fresh worker process pinned to `cpu` (-1: not pinned)."""
    for name, v in (("page", page), ("nodes", nodes), ("repeat", repeat)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    folder = ensure_dynamo()

    def run(data: Path, result: Path) -> None:
        args = [str(folder), str(data), str(page), str(nodes), str(repeat), str(result), str(cpu)]
        _run_script("dynamo_worker.py", ["rounds", *args], "Dynamo")

    out = _run_on_sequences(sequences, run)
    return DynamoRun(
        out["rounds_per_s"],
        out["hashing_rounds_per_s"],
        tuple((w, have) for w, have in out["answers"]),
    )


def _run_on_sequences(
    sequences: Sequence[Sequence[int]], run: Callable[[Path, Path], None]
) -> dict:
    """`run(data, result)` with the sequences written to `data` (write_sequences' format);
    what the worker wrote to `result`, as JSON."""
    lengths, flat = pack_sequences(sequences)
    with tempfile.TemporaryDirectory(prefix="kvf-peer-") as tmp:
        data, result = Path(tmp) / "sequences.bin", Path(tmp) / "result.json"
        write_sequences(data, lengths, flat)
        run(data, result)
        return json.loads(result.read_text())


def sglang_radix_ops_per_s(
    sequences: list[list[int]], page_size: int, *, gc_mode: str = "default"
) -> float:
    """Requests per second of SGLang 0.5.23's radix cache (match_prefix + insert per request)."""
    return run_sglang_radix(sequences, page_size, gc_mode=gc_mode).ops_per_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="SGLang radix-cache peer on the packaged trace")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--gc",
        choices=GC_MODES,
        default="default",
        help="collector state before the timed loop (see run_sglang_radix)",
    )
    parser.add_argument(
        "--cache", choices=[c.value for c in SglangCache], default=SglangCache.PYTHON.value
    )
    args = parser.parse_args(argv)

    from kvfabric.deploy.sim.trace import load_trace, request_tokens

    trace = load_trace(limit=args.requests)
    sequences = [request_tokens(r, args.tokens_per_block) for r in trace]
    run = run_sglang_radix(
        sequences, args.page_size, gc_mode=args.gc, cache=SglangCache(args.cache)
    )
    total = sum(map(len, sequences))
    print(
        json.dumps(
            {
                "peer": f"sglang-{SGLANG_VERSION}",
                "cache": run.cache.label,
                "requests": run.requests,
                "page_size": run.page_size,
                "gc_mode": run.gc_mode,
                "tokens": total,
                "matched_tokens": sum(run.match_lengths),
                "elapsed_s": round(run.elapsed_s, 4),
                "ops_per_s": round(run.ops_per_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
