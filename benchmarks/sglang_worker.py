"""The SGLang peer's worker process, and the file of token sequences it is handed.

``benchmarks/peers.py`` runs this file as a script with ``python -I``: isolated, so neither
benchmarks/ nor ``$PYTHONPATH`` comes ahead of our site-packages, and the SGLang folder is
appended after them (our torch and numpy win). Only the stdlib is imported at the top, so the
caller can import the sequence file helpers without SGLang.

``python -I sglang_worker.py check FOLDER``: import SGLang's caches from FOLDER and check
one match on each. ``python -I sglang_worker.py CACHE FOLDER DATA PAGE_SIZE RESULT GC_MODE CPU``:
time match_prefix + insert over the sequences in DATA on one CACHE (see CACHES), pinned to
CPU (-1: not pinned), and write the result JSON to RESULT.

The caches: ``radix`` is the pure-Python ``RadixCache`` (the simulated tree SGLang's scheduler
keeps for its waiting queue); ``unified`` is ``UnifiedRadixCache``, SGLang's default prefix
cache, on its Rust TreeCore, with a no-op allocator (the tree never owns real KV slots here);
``rust`` is that TreeCore's binding called directly, without the Python wrapper.
"""

from __future__ import annotations

import json
import sys
import time
from array import array
from collections.abc import Sequence
from pathlib import Path


def pack_sequences(sequences: Sequence[Sequence[int]]) -> tuple[array, array]:
    """(lengths, concatenated ids) as int64 arrays; ValueError names a bad sequence."""
    lengths = array("q", [len(s) for s in sequences])
    flat = array("q")
    for i, seq in enumerate(sequences):
        try:
            flat.extend(seq)
        except (TypeError, OverflowError) as e:
            raise ValueError(f"sequence {i} must hold int64 token ids: {e}") from None
    return lengths, flat


def write_sequences(path: Path, lengths: array, flat: array) -> None:
    with path.open("wb") as f:
        array("q", [len(lengths)]).tofile(f)
        lengths.tofile(f)
        flat.tofile(f)


def read_sequences(path: Path) -> list[array]:
    with path.open("rb") as f:
        header = array("q")
        header.fromfile(f, 1)
        lengths = array("q")
        lengths.fromfile(f, header[0])
        flat = array("q")
        flat.fromfile(f, sum(lengths))
    sequences, offset = [], 0
    for n in lengths:
        sequences.append(flat[offset : offset + n])
        offset += n
    return sequences


def _tolerate_cpu_torchvision(folder: Path) -> None:
    """PyPI's torchvision wheels link CUDA torch, so beside a CPU torch their C ops don't load
    and ``import torchvision`` dies registering fake kernels for them ("operator
    torchvision::nms does not exist"). SGLang only needs torchvision's Python transforms at
    import time, so when the ops can't load, skip those registrations (worker process only)."""
    import types

    import torch

    libs = sorted((folder / "torchvision").glob("_C*.so"))
    try:
        for lib in libs:
            torch.ops.load_library(str(lib))
        if libs:
            return
    except OSError:
        pass  # the ops cannot load beside a CPU torch: skip their registrations below
    name = "torchvision._meta_registrations"
    sys.modules[name] = types.ModuleType(name)


CACHES = ("radix", "unified", "rust")


def pin(cpu: int) -> None:
    """Run this process (and the threads it starts from now on) on one CPU; -1 leaves it be."""
    if cpu >= 0:
        import os

        os.sched_setaffinity(0, {cpu})


def _import_sglang(folder: Path):
    sys.path.append(str(folder))  # after our site-packages: our torch/numpy win
    _tolerate_cpu_torchvision(folder)
    import torch

    torch.set_num_threads(1)  # the caches' tensors are tiny: no intra-op pool to wake
    import sglang.srt.mem_cache.base_prefix_cache as base
    import sglang.srt.mem_cache.radix_cache as radix

    return torch, base, radix


class _NoOpAllocator:
    """The KV slot allocator UnifiedRadixCache frees through: the values inserted here are
    made up, so the slots the tree drops (an insert's overlap) go nowhere."""

    device = "cpu"

    def free(self, indices) -> None:
        """Nothing to give back: no slot behind the made-up values was ever taken."""

    def free_segment(self, indices, start_pos: int = 0) -> None:
        """As `free`."""

    def free_full_segment(self, indices, start_pos: int = 0) -> None:
        """As `free`."""


def _unified_cache(page_size: int):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,  # only Mamba's component reads it
        token_to_kv_pool_allocator=_NoOpAllocator(),
        page_size=page_size,
        tree_components=(ComponentType.FULL,),
        tree_core_backend="rust",
    )
    cache = UnifiedRadixCache(params)
    core = type(cache.tree_core).__name__
    if core != "RustUnifiedTreeCore":  # SGLang falls back to Python quietly: say so loudly
        raise SystemExit(f"UnifiedRadixCache runs on {core}, not the Rust TreeCore")
    return cache


def _rust_binding(page_size: int):
    from sglang.srt.mem_cache.rust_tree_core.extension import bindings
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    init = bindings.TreeCoreInitParamsBinding(
        eviction_policy="lru", page_size=page_size, device="cpu"
    )
    return bindings, bindings.RustUnifiedTreeCoreBinding(init, [int(ComponentType.FULL)])


def _check(torch, base, radix) -> None:
    ids = array("q", [1, 2, 3, 4, 5])
    tree = radix.RadixCache.create_simulated(page_size=2)
    tree.insert(
        base.InsertParams(key=radix.RadixKey(token_ids=ids), value=torch.empty(5, dtype=torch.bool))
    )
    got = {"radix": tree.match_prefix(base.MatchPrefixParams(key=radix.RadixKey(token_ids=ids)))}
    cache = _unified_cache(page_size=2)
    value = torch.arange(5, dtype=torch.int64)
    cache.insert(base.InsertParams(key=radix.RadixKey(token_ids=ids), value=value))
    got["unified"] = cache.match_prefix(base.MatchPrefixParams(key=radix.RadixKey(token_ids=ids)))
    bindings, core = _rust_binding(page_size=2)
    core.insert(bindings.InsertParamsBinding(key=ids, value=value))
    got["rust"] = core.match_prefix(bindings.MatchParamsBinding(key=ids))
    for name, m in got.items():
        if m.device_prefix_len != 4:
            raise SystemExit(f"{name} self-check: matched {m.device_prefix_len} tokens, expected 4")


def _replay(cache: str, sequences: list[array], page_size: int, torch, base, radix):
    """(seconds, matched tokens per request) of match_prefix then insert per request.

    As SGLang's scheduler drives a tree: match the request's ids, then insert them with a
    value of the same length (the Python tree's simulated values are bools; the unified
    cache's are int64 KV slot ids, made up here)."""
    empty, clock = torch.empty, time.perf_counter
    matched: list[int] = []
    append = matched.append
    int64 = torch.int64
    if cache in ("radix", "unified"):  # the Python trees: one API, their own values
        if cache == "radix":
            tree, dtype = radix.RadixCache.create_simulated(page_size=page_size), torch.bool
        else:
            tree, dtype = _unified_cache(page_size), int64
        Key, Match, Insert = radix.RadixKey, base.MatchPrefixParams, base.InsertParams
        start = clock()
        for ids in sequences:
            m = tree.match_prefix(Match(key=Key(token_ids=ids)))
            tree.insert(Insert(key=Key(token_ids=ids), value=empty(len(ids), dtype=dtype)))
            append(m.device_prefix_len)
        return clock() - start, matched
    bindings, core = _rust_binding(page_size)
    MatchB, InsertB = bindings.MatchParamsBinding, bindings.InsertParamsBinding
    start = clock()
    for ids in sequences:
        m = core.match_prefix(MatchB(key=ids))
        core.insert(InsertB(key=ids, value=empty(len(ids), dtype=int64)))
        append(m.device_prefix_len)
    return clock() - start, matched


def main(argv: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    mode, folder = argv[0], Path(argv[1])
    if mode == "check":
        _check(*_import_sglang(folder))
        return
    if mode not in CACHES:
        raise SystemExit(f"unknown worker mode {mode!r}")
    data, page_size, result, gc_mode = Path(argv[2]), int(argv[3]), Path(argv[4]), argv[5]
    pin(int(argv[6]))  # before the imports start any thread
    torch, base, radix = _import_sglang(folder)
    sequences = read_sequences(data)
    if gc_mode in ("collect", "freeze"):
        import gc

        gc.collect()
        if gc_mode == "freeze":
            gc.freeze()
    elapsed, matched = _replay(mode, sequences, page_size, torch, base, radix)
    result.write_text(json.dumps({"elapsed_s": elapsed, "match_lengths": matched}))


if __name__ == "__main__":
    main(sys.argv[1:])
