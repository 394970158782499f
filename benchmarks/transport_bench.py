"""Page READ throughput: NIXL between two processes vs torch copies vs Ray's object store.

Each row moves `pages` scattered pages of `page_bytes` (random distinct indices on both
sides out of a 1024-page pool, as a fragmented cache holds them):
  nixl     a peer process exposes its pools; this process reads into its own pools
           (one batched READ per batch over prepared descriptor lists, deadline-checked);
  memcpy   pages copied between two pools of this process: the faster of
           index_select + index_copy_ (what kvfabric.core.cache.page_bytes.TorchCopier does) and a
           per-page copy_ loop;
  page_copy  the per-page copy_ loop alone: the JSON's ratio_vs_page_copy_64k (64 KiB x 64)
           and ratio_vs_page_copy_4k (4 KiB x 1024) are nixl / page_copy, same run;
  cma      the kernel's limit for NIXL's path on one host (UCX picks CMA): the same pages
           read from the peer by process_vm_readv itself, every page an iovec pair, up to
           IOV_MAX pages a call (UCX makes one call per descriptor); host memory only;
  ray      one actor `ray.put`s the gathered pages, another `ray.get`s them and
           scatters them into its pool, timed inside the second actor.
GB/s = bytes moved / median time of one batch, best of 3 rounds (the host is shared).
Steady state: each row's first reps are discarded (warm-up), and so is a whole first
round; GC is collected before each row's timing and disabled during it. Each side is
pinned to one core (the reader's thread to its first allowed core, the peer to its
last), and both run torch on one thread: a 64 KiB copy_ would otherwise fan out to
OpenMP threads that share the pinned core (64 copies took 180 ms instead of 0.4 ms).
The reader's NIXL threads (progress, UCX async) go to the peer's core: on the reader's
core, the progress thread contends for the UCX worker's spinlock while the reader posts,
and 16 MiB reads ran 3-4x slower (2.5 instead of 8-9 GB/s), an artefact of pinning.
KVF_TEST_DEVICE=cuda puts the NIXL and memcpy pools on the GPU; Ray's stay in host
memory (its actors here get no GPU). UCX_TLS=tcp makes the NIXL path mimic two hosts.
Run: .venv/bin/python -m benchmarks.transport_bench
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import numpy as np
import torch

PAGE_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10)
BATCHES = (64, 256)
CAPACITY = 1024
ROW_64K = (64 << 10, 64)  # the rows the JSON's ratios name
ROW_4K = (4 << 10, 1024)  # every page of the pool, permuted
ROWS = [(p, n) for p in PAGE_SIZES for n in BATCHES] + [ROW_4K]
INDEX_SETS = 8  # distinct scattered (remote, local) index sets, cycled
ROUNDS = 3  # best of rounds: the host is shared, load comes and goes
PEER = "bench-peer"
DEVICE = os.environ.get("KVF_TEST_DEVICE", "cpu")


@dataclass
class Row:
    page_bytes: int
    pages: int
    nixl_gbps: float
    memcpy_gbps: float
    page_copy_gbps: float  # the per-page copy_ loop alone
    cma_limit_gbps: float | None  # raw process_vm_readv; None: not measurable here
    ray_object_store_gbps: float | None  # None: not measured (--no-object-store)


def pool_name(page_bytes: int) -> str:
    return f"p{page_bytes >> 10}k"


def make_pools(device: str, fill: bool) -> dict[str, torch.Tensor]:
    make = torch.ones if fill else torch.zeros
    return {pool_name(p): make((CAPACITY, p), dtype=torch.uint8, device=device) for p in PAGE_SIZES}


def index_sets(pages: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.choice(CAPACITY, pages, replace=False), rng.choice(CAPACITY, pages, replace=False))
        for _ in range(INDEX_SETS)
    ]


def pin_to(core: int) -> None:
    """This thread, and the threads it starts from now on, on `core`; torch on one."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


def thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def pin_threads(tids: set[int], core: int) -> None:
    """Move threads of this process (e.g. those a NIXL agent started) onto `core`."""
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {core})
        except ProcessLookupError:
            pass  # a thread that has exited since it was listed


def side_cores() -> tuple[int, int]:
    """(reader's core, peer's core): apart when this process may use two."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[0], cores[-1]


def median_gbps(nbytes: int, times: list[float]) -> float:
    return round(nbytes / statistics.median(times) / 1e9, 3)


def time_reps(
    fn: Callable[[int], None],
    warmup: int = 3,
    min_reps: int = 15,
    max_reps: int = 400,
    budget_s: float = 0.25,
) -> list[float]:
    """Durations of fn(i) after a warm-up; as many reps as `budget_s` allows. GC is
    collected first and kept off while timing (a collection in one rep would skew it)."""
    for i in range(warmup):
        fn(i)
    gc.collect()
    gc.disable()
    times: list[float] = []
    try:
        start = time.perf_counter()
        while len(times) < max_reps and (
            len(times) < min_reps or time.perf_counter() - start < budget_s
        ):
            t0 = time.perf_counter()
            fn(len(times))
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return times


# -- NIXL ------------------------------------------------------------------------------


def serve_peer(conn, device: str, core: int) -> None:
    """Peer process: register filled pools, hand out metadata, idle until told to quit."""
    from kvfabric.transport.nixl_transport import NixlTransport

    pin_to(core)  # before the agent starts, so its progress thread is pinned too
    transport = NixlTransport(PEER)
    pools = make_pools(device, fill=True)
    for name, tensor in pools.items():
        transport.register_pool(name, tensor)
    conn.send(transport.metadata())
    parent = os.getppid()
    while os.getppid() == parent and not (conn.poll(0.2) and conn.recv() == "quit"):
        pass  # serve reads until told to quit or orphaned (poll waits 0.2 s)
    transport.close()


@contextmanager
def nixl_peer(device: str, core: int) -> Iterator[tuple[bytes, int]]:
    """The peer's (metadata, process id) while it runs."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=serve_peer, args=(child, device, core), daemon=True)
    proc.start()
    child.close()  # so that a peer dying during start-up reads as EOF, not a long wait
    try:
        if not conn.poll(120):
            raise TimeoutError("NIXL peer process did not start within 120 s")
        try:
            metadata = conn.recv()
        except EOFError:
            raise RuntimeError(f"NIXL peer process died (exit code {proc.exitcode})") from None
        yield metadata, proc.pid
    finally:
        if proc.is_alive():
            conn.send("quit")
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def nixl_reader(
    transport, pools: dict[str, torch.Tensor], page_bytes: int, pages: int
) -> Callable[[int], None]:
    sets = index_sets(pages, seed=pages)
    name = pool_name(page_bytes)

    def read(i: int) -> None:
        r, l_ = sets[i % INDEX_SETS]
        transport.wait(transport.read(PEER, {name: (r, l_)}), 10.0)

    return read


class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux's UIO_MAXIOV)


def cma_reader(
    pid: int, local_base: int, remote_base: int, page_bytes: int, pages: int
) -> Callable[[int], None] | None:
    """process_vm_readv of the same pages (ordered by remote page, as the transport posts
    them), iovecs built outside the timing; None where the kernel refuses (ptrace scope)."""
    libc = ctypes.CDLL(None, use_errno=True)
    readv = libc.process_vm_readv
    iov, count = ctypes.c_void_p, ctypes.c_ulong
    readv.argtypes = [ctypes.c_int, iov, count, iov, count, ctypes.c_ulong]
    readv.restype = ctypes.c_ssize_t
    batches = []
    for r, l_ in index_sets(pages, seed=pages):
        order = np.argsort(r, kind="stable")
        r, l_ = r[order], l_[order]
        calls = []
        for at in range(0, pages, IOV_MAX):
            k = min(IOV_MAX, pages - at)
            dst = (Iovec * k)(*[(local_base + int(j) * page_bytes, page_bytes) for j in l_[at:]])
            src = (Iovec * k)(*[(remote_base + int(j) * page_bytes, page_bytes) for j in r[at:]])
            calls.append((dst, src, k))
        batches.append(calls)

    def read(i: int) -> None:
        for dst, src, k in batches[i % INDEX_SETS]:
            if readv(pid, dst, k, src, k, 0) != k * page_bytes:
                raise OSError(ctypes.get_errno(), "process_vm_readv fell short")

    try:
        read(0)
    except OSError:
        return None
    return read


def memcpy_copiers(
    src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], page_bytes: int, pages: int
) -> list[Callable[[int], None]]:
    """Two ways to copy scattered pages in-process: a gather + scatter (two passes over
    the bytes, through a temporary) and a per-page copy_ loop (one pass, a call per
    page). The baseline is whichever is faster here."""
    name = pool_name(page_bytes)
    device = dst[name].device
    sets = [
        (torch.from_numpy(r).to(device), torch.from_numpy(l_).to(device))
        for r, l_ in index_sets(pages, seed=pages)
    ]
    lists = [(r.tolist(), l_.tolist()) for r, l_ in sets]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def gather_scatter(i: int) -> None:
        r, l_ = sets[i % INDEX_SETS]
        dst[name].index_copy_(0, l_, src[name].index_select(0, r))
        sync()

    def per_page(i: int) -> None:
        r, l_ = lists[i % INDEX_SETS]
        s, d = src[name], dst[name]
        for a, b in zip(r, l_):
            d[b].copy_(s[a])
        sync()

    return [gather_scatter, per_page]


Figures = dict[tuple[int, int], float]


def bench_nixl_and_memcpy(
    metadata: bytes,
    peer_pid: int,
    device: str,
    rows: list[tuple[int, int]],
    rounds: int,
    warmup_round: bool,
    agent_core: int,
) -> tuple[Figures, Figures, Figures, Figures]:
    """Best-of-`rounds` medians of (nixl, memcpy, page_copy, cma); they alternate so that all
    see the same host load. With `warmup_round`, a first round runs and is discarded.
    The threads the reader's NIXL agent starts are moved to `agent_core`."""
    from kvfabric.transport.base import PeerMetadata
    from kvfabric.transport.nixl_transport import NixlTransport

    nixl: Figures = {}
    memcpy: Figures = {}
    page_copy: Figures = {}
    cma: Figures = {}
    peer_pools = PeerMetadata.from_bytes(metadata).pools
    src, dst = make_pools(device, fill=True), make_pools(device, fill=False)
    before = thread_ids()
    with NixlTransport("bench-reader") as transport:
        pin_threads(thread_ids() - before, agent_core)
        pools = make_pools(device, fill=False)
        for name, tensor in pools.items():
            transport.register_pool(name, tensor)
        transport.connect(PEER, metadata)
        for round_ in range(rounds + warmup_round):
            keep = round_ >= warmup_round
            for key in rows:
                nbytes = key[0] * key[1]
                gbps = median_gbps(nbytes, time_reps(nixl_reader(transport, pools, *key)))
                if keep:
                    nixl[key] = max(nixl.get(key, 0.0), gbps)
                gather_scatter, per_page = memcpy_copiers(src, dst, *key)
                gs_gbps = median_gbps(nbytes, time_reps(gather_scatter))
                pp_gbps = median_gbps(nbytes, time_reps(per_page))
                if keep:
                    memcpy[key] = max(memcpy.get(key, 0.0), gs_gbps, pp_gbps)
                    page_copy[key] = max(page_copy.get(key, 0.0), pp_gbps)
                name = pool_name(key[0])
                raw = None
                if device == "cpu":
                    local_base = pools[name].data_ptr()
                    raw = cma_reader(peer_pid, local_base, peer_pools[name].base, *key)
                if raw is not None:
                    gbps = median_gbps(nbytes, time_reps(raw))
                    if keep:
                        cma[key] = max(cma.get(key, 0.0), gbps)
        if not all(bool(pools[pool_name(page_bytes)].any()) for page_bytes, _ in rows):
            raise AssertionError("NIXL reads did not land in the reader's pools")
    return nixl, memcpy, page_copy, cma


# -- Ray object store ----------------------------------------------------------------------


@contextmanager
def local_ray() -> Iterator[None]:
    """A private, short-lived local cluster. Ray 2.60 turns token auth on by default and
    would write a token to ~/.ray/auth_token; instead we keep auth on with a throw-away
    token passed through the environment (inherited by Ray's workers), so nothing lands
    in the user's home and the cluster is not left open while it runs."""
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    already_imported = "ray" in sys.modules
    import ray

    if already_imported:  # Ray caches its config at import; refresh it as Ray itself does
        from ray._raylet import Config

        Config.initialize("")
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
    finally:
        ray.shutdown()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def bench_ray(rows: list[tuple[int, int]], rounds: int) -> dict[tuple[int, int], float]:
    import ray

    @ray.remote(num_cpus=1)
    class Holder:
        def __init__(self) -> None:
            self.pools = make_pools("cpu", fill=True)

        def gather(self, name: str, idx: np.ndarray) -> list:
            # Nested in a list so the caller gets the reference, not an inlined copy.
            return [ray.put(self.pools[name].index_select(0, torch.from_numpy(idx)))]

    @ray.remote(num_cpus=1)
    class Fetcher:
        def __init__(self) -> None:
            self.pools = make_pools("cpu", fill=False)

        def fetch(self, holder, name: str, sets: list) -> list[float]:
            def one(i: int) -> None:
                r, l_ = sets[i % len(sets)]
                [ref] = ray.get(holder.gather.remote(name, r), timeout=60)
                self.pools[name].index_copy_(0, torch.from_numpy(l_), ray.get(ref, timeout=60))

            return time_reps(one)

    holder, fetcher = Holder.remote(), Fetcher.remote()
    results: dict[tuple[int, int], float] = {}
    for _ in range(rounds):
        for key in rows:
            times = ray.get(
                fetcher.fetch.remote(holder, pool_name(key[0]), index_sets(key[1], seed=key[1])),
                timeout=300,
            )
            results[key] = max(results.get(key, 0.0), median_gbps(key[0] * key[1], times))
    return results


# -- report ---------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    print(
        f"{'page':>6} {'pages':>5} {'nixl GB/s':>10} {'memcpy GB/s':>12} "
        f"{'page copy_':>11} {'cma GB/s':>9} {'ray GB/s':>9} {'nixl/ray':>9} "
        f"{'nixl/memcpy':>12} {'nixl/page copy_':>16} {'nixl/cma':>9}"
    )
    for r in rows:
        ray_os, cma = r.ray_object_store_gbps, r.cma_limit_gbps
        print(
            f"{r.page_bytes >> 10:>5}K {r.pages:>5} {r.nixl_gbps:>10.2f} "
            f"{r.memcpy_gbps:>12.2f} {r.page_copy_gbps:>11.2f} "
            f"{'-' if cma is None else f'{cma:.2f}':>9} "
            f"{'-' if ray_os is None else f'{ray_os:.2f}':>9} "
            f"{'-' if ray_os is None else f'{r.nixl_gbps / ray_os:.2f}':>9} "
            f"{r.nixl_gbps / r.memcpy_gbps:>12.2f} {r.nixl_gbps / r.page_copy_gbps:>16.2f} "
            f"{'-' if cma is None else f'{r.nixl_gbps / cma:.2f}':>9}"
        )


def ratio_at(rows: list[Row], page_bytes: int, field: str) -> float:
    """Mean over batch sizes of nixl / baseline at one page size."""
    sel = [r for r in rows if r.page_bytes == page_bytes]
    return round(statistics.mean(r.nixl_gbps / getattr(r, field) for r in sel), 3)


def cma_ratio(rows: list[Row], key: tuple[int, int]) -> float | None:
    """nixl / raw process_vm_readv at one row; None where either was not measured."""
    sel = [r for r in rows if (r.page_bytes, r.pages) == key and r.cma_limit_gbps]
    return round(sel[0].nixl_gbps / sel[0].cma_limit_gbps, 3) if sel else None


def page_copy_ratio(rows: list[Row], key: tuple[int, int]) -> float | None:
    """nixl / per-page copy_ at one row; None where the row was not measured."""
    sel = [r for r in rows if (r.page_bytes, r.pages) == key]
    return round(sel[0].nixl_gbps / sel[0].page_copy_gbps, 3) if sel else None


def run(
    json_out: bool,
    object_store: bool = True,
    rows: list[tuple[int, int]] = ROWS,
    rounds: int = ROUNDS,
    warmup_round: bool = True,
) -> dict:
    """Measure every row, print the table (and, with json_out, a final JSON line).
    Without `object_store` (a host without Ray) the object store's column is left out."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("KVF_TEST_DEVICE=cuda but CUDA is not available")
    reader_core, peer_core = side_cores()
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        with nixl_peer(DEVICE, peer_core) as (metadata, peer_pid):
            pin_to(reader_core)  # after the peer starts: it must not inherit this core
            nixl, memcpy, page_copy, cma = bench_nixl_and_memcpy(
                metadata, peer_pid, DEVICE, rows, rounds, warmup_round, agent_core=peer_core
            )
    finally:  # Ray's workers below inherit this process's affinity
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    ray_os: dict[tuple[int, int], float] = {}
    if object_store:
        with local_ray():
            ray_os = bench_ray(rows, rounds)
    measured = [
        Row(
            p,
            n,
            nixl[(p, n)],
            memcpy[(p, n)],
            page_copy[(p, n)],
            cma.get((p, n)),
            ray_os.get((p, n)),
        )
        for p, n in rows
    ]
    result = {
        "name": "transport",
        "device": DEVICE,
        "rows": [asdict(r) for r in measured],
        "ratio_vs_object_store_64k": ratio_at(measured, 64 << 10, "ray_object_store_gbps")
        if object_store
        else None,
        "ratio_vs_memcpy_64k": ratio_at(measured, 64 << 10, "memcpy_gbps"),
        "ratio_vs_page_copy_64k": page_copy_ratio(measured, ROW_64K),
        "ratio_vs_page_copy_4k": page_copy_ratio(measured, ROW_4K),
        "ratio_vs_cma_limit_64k": cma_ratio(measured, ROW_64K),
        "ratio_vs_cma_limit_4k": cma_ratio(measured, ROW_4K),
        # How the figures are steady: warm-up reps are always discarded.
        "warmup_round_discarded": warmup_round,
        "gc": "collected before each timing, disabled during it",
        "cores": {"reader": reader_core, "peer": peer_core, "reader_nixl_threads": peer_core},
    }
    print_table(measured)
    if json_out:
        print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvfabric bench transport",
        description="NIXL page reads against memcpy and the Ray object store.",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    ap.add_argument(
        "--no-object-store",
        action="store_true",
        help="leave out the Ray object store (a host without Ray, e.g. a bare GPU machine)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the ratios' two rows (64 KiB x 64, 4 KiB x 1024), one round, no warm-up "
        "round: that the bench runs, not a figure",
    )
    args = ap.parse_args(argv)
    rows, rounds = ([ROW_64K, ROW_4K], 1) if args.quick else (ROWS, ROUNDS)
    run(
        json_out=args.json,
        object_store=not args.no_object_store,
        rows=rows,
        rounds=rounds,
        warmup_round=not args.quick,
    )
    return 0


if __name__ == "__main__":
    main()
