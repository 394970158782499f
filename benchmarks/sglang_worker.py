"""The SGLang peer's worker process, and the file of token sequences it is handed.

``benchmarks/peers.py`` runs this file as a script with ``python -I``: isolated, so neither
benchmarks/ nor ``$PYTHONPATH`` comes ahead of our site-packages, and the SGLang folder is
appended after them (our torch and numpy win). Only the stdlib is imported at the top, so the
caller can import the sequence file helpers without SGLang.

``python -I sglang_worker.py check FOLDER``: import SGLang's radix cache from FOLDER and
check one match. ``python -I sglang_worker.py radix FOLDER DATA PAGE_SIZE RESULT GC_MODE``:
time match_prefix + insert over the sequences in DATA, write the result JSON to RESULT.
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


def _import_sglang(folder: Path):
    sys.path.append(str(folder))  # after our site-packages: our torch/numpy win
    _tolerate_cpu_torchvision(folder)
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    return torch, RadixCache, RadixKey, MatchPrefixParams, InsertParams


def main(argv: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    mode, folder = argv[0], Path(argv[1])
    torch, RadixCache, RadixKey, MatchPrefixParams, InsertParams = _import_sglang(folder)
    if mode == "check":
        tree = RadixCache.create_simulated(page_size=2)
        ids = array("q", [1, 2, 3, 4, 5])
        tree.insert(
            InsertParams(key=RadixKey(token_ids=ids), value=torch.empty(5, dtype=torch.bool))
        )
        got = tree.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=ids))).device_prefix_len
        if got != 4:
            raise SystemExit(f"radix cache self-check: matched {got} tokens, expected 4")
        return
    if mode != "radix":
        raise SystemExit(f"unknown worker mode {mode!r}")
    data, page_size, result, gc_mode = Path(argv[2]), int(argv[3]), Path(argv[4]), argv[5]
    sequences = read_sequences(data)
    if gc_mode in ("collect", "freeze"):
        import gc

        gc.collect()
        if gc_mode == "freeze":
            gc.freeze()
    tree = RadixCache.create_simulated(page_size=page_size)
    empty, boolean = torch.empty, torch.bool
    matched: list[int] = []
    # As SGLang's scheduler drives its simulated tree (schedule_policy._compute_prefix_matches):
    # match the request's ids, then insert them with a dummy value of the same length.
    start = time.perf_counter()
    for ids in sequences:
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=ids)))
        tree.insert(InsertParams(key=RadixKey(token_ids=ids), value=empty(len(ids), dtype=boolean)))
        matched.append(m.device_prefix_len)
    elapsed = time.perf_counter() - start
    result.write_text(json.dumps({"elapsed_s": elapsed, "match_lengths": matched}))


if __name__ == "__main__":
    main(sys.argv[1:])
