"""A fabric hit in a real vLLM engine, against what the engine does without the fabric.

One vLLM CPU engine with the FabricConnector, in this process (VLLM_ENABLE_V1_MULTIPROCESSING
off, so both sides of the connector run here and the worker's copies can be timed), on the
vLLM demo model stretched to a long prompt (8 layers, 2 KV heads x 64, fp32, blocks of 32,
full and sliding-window layers alternating), on a one-node Ray cluster with the fabric. In
one run, each figure against its limit:

  ttft      a prompt of --tokens tokens (one request, one output token): computed (nothing
            cached; --save-runs times, all but the first under salts of their own, each
            saved), hit in vLLM's own prefix cache (the device hit: the limit), and hit in
            the fabric after vLLM's prefix cache was reset (loaded from the node's pools);
            `ttft_ratio_vs_device_hit` = fabric hit / device hit.
  worker    the worker's copies of those hits (staging -> vLLM's blocks) and of those saves
            (blocks -> staging; medians), each from the copy thread's plan to the end of the
            C copy queue's copy, against one thread's memcpy of the same bytes in this
            process (same run): `worker_load_ratio_vs_memcpy`, `worker_save_ratio_vs_memcpy`;
            the same with the two threads' CPU time (`..._cpu_ratio_vs_memcpy`): wall above
            CPU is time it waited for a core.
  node      the node actor's copies for the same prompt (its load into staging, its save
            from staging), by the code the actor runs (benchmarks/staging_bench.py, in this
            process): `node_load_ratio_vs_memcpy`, `node_save_ratio_vs_memcpy`.
  decode    --decoders requests whose prompt and output stay within one block (nothing to
            load or save: what the connector costs a step), tokens/s against the same
            engine arguments without the connector, in a child process beside an idle Ray
            cluster of its own (the fabric's actors are the connector's cost, Ray's
            daemons are not), the two engines' runs alternating:
            `decode_ratio_vs_no_connector`.
  stall     the decoders again, with longer outputs, beside one request for the long prompt
            (a fabric hit), its node stopped (SIGSTOP) for --stall-s seconds as it asks:
            the decoders' tokens/s against the same run with the node answering at once
            (`decode_ratio_with_stalled_load`; 1.0: the wait costs the others nothing);
            every such request must still be a fabric hit.

Steady state: a warm-up request first, and three untimed decode runs before the timed
ones on both engines (an engine's first decode runs are slower); Python's collector runs
before each timed part. TTFT and the stall's decode rates are medians of --repeat runs;
the decode rates with nothing to move are medians of --decode-runs runs (~0.2 s each),
one engine's run then the other's, so a busy moment of the machine falls on both.
Decode rates are the decoders' tokens after their first over the engine's timestamps
of their first and last tokens. Both engines bind their forward to the cores vLLM
gives an engine without a connector (`reserve_as_the_stock_engine`: on a 2-core host
core 0, the other reserved); the node actor is another process, as in production.
Both engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), where vLLM binds
nothing: `bind_as_a_vllm_worker` gives each the binding its multiprocess executor would
give the worker (else the forward's OpenMP threads took both cores, and the copy thread
waited for one: worker copies of 11-14 ms wall for 4-5.5 ms on the CPU).
Run: .venv/bin/kvfabric bench connector [--tokens N] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, Callable

import numpy as np
from kvfabric.deploy.demo.load import reserve_as_the_stock_engine

BLOCK = 32
ENGINE_KV_BYTES = 320 << 20
WARM_RUNS = 3


def engine_args(tokens: int, connector: dict | None) -> dict:
    return dict(
        enforce_eager=True,
        dtype="float32",
        seed=0,
        max_model_len=tokens + 2 * BLOCK,
        block_size=BLOCK,
        kv_cache_memory_bytes=ENGINE_KV_BYTES,
        disable_log_stats=False,
        kv_transfer_config=connector,
    )


def model_path(tokens: int) -> str:
    from kvfabric.deploy.vllm.serve.model import DEMO_SPEC, ensure_tiny_model

    spec = replace(DEMO_SPEC, max_positions=tokens + 4 * BLOCK)
    return str(ensure_tiny_model(spec, say=lambda m: print(m, file=sys.stderr)))


def median_s(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def decode_rate(llm, decoders: int, out_tokens: int, extra: list[Any] | None = None) -> float:
    """Tokens/s of `decoders` requests after their first token (4-token prompts, each under
    a salt of its own, so nothing is cached), `extra` requests beside them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    items = [
        TokensPrompt(prompt_token_ids=[7 + i, 8, 9, 10], cache_salt=uuid.uuid4().hex)
        for i in range(decoders)
    ]
    params = [SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)] * decoders
    for item in extra or []:
        items.append(item)
        params.append(SamplingParams(temperature=0, max_tokens=1))
    gc.collect()
    outs = llm.generate(items, params, use_tqdm=False)[:decoders]
    # The decode phase: from the decoders' first tokens to their last (engine timestamps).
    start = min(o.metrics.first_token_ts for o in outs)
    end = max(o.metrics.last_token_ts for o in outs)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (end - start)


def reset_prefix_cache(llm) -> None:
    """vLLM's own prefix cache emptied. A finished request's blocks stay vLLM's until its
    save is reported copied, at a step: the offline engine steps only in generate."""
    from vllm import SamplingParams

    for _ in range(100):
        if llm.reset_prefix_cache():
            return
        llm.generate(
            [{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=1), use_tqdm=False
        )
    raise RuntimeError("vLLM's prefix cache could not be reset")


class CopyClock:
    """Times the worker's copies and counts the bytes each moves (take: [(seconds, bytes,
    CPU seconds)] of the loads or the saves). A copy starts as the copy thread plans it
    (WorkerSide._copy) and ends as its bytes are there: as the C copy queue's thread ends
    it (its ticket), or as _copy returns where it copies itself. Its CPU time is the copy
    thread's and the queue thread's for it; wall time above CPU time is how long it waited
    for a core."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.records: list[tuple[int, int, object, int, int, bool]] = []
        copy = worker._copy

        def timed(job, to_blocks: bool):
            start, cpu = time.monotonic_ns(), time.thread_time_ns()
            ticket = copy(job, to_blocks)
            end, cpu = time.monotonic_ns(), time.thread_time_ns() - cpu
            self.records.append((start, end, ticket, cpu, self._bytes(job), to_blocks))
            return ticket

        worker._copy = timed

    def _bytes(self, job) -> int:
        n = 0
        for move in job.moves:
            layer_page = self.worker.shared.pools[move.pool][0, 0]
            for slot in self.worker.by_pool[move.pool]:
                pages = sum(1 for b in move.blocks[slot.group] if b >= 0)
                n += pages * layer_page.numel() * layer_page.element_size()
        return n

    def take(self, to_blocks: bool) -> list[tuple[float, int, float]]:
        out = []
        for start, end, ticket, cpu, n, t in self.records:
            if t != to_blocks:
                continue
            if ticket is not None:
                if not ticket.wait(60.0):
                    raise RuntimeError("a worker copy did not end in 60 s")
                end, cpu = ticket.ended_ns, cpu + ticket.cpu_ns
            out.append(((end - start) / 1e9, n, cpu / 1e9))
        self.records = [r for r in self.records if r[5] != to_blocks]
        return out


def bind_as_a_vllm_worker() -> None:
    """This process's engine bound as vLLM's multiprocess executor binds a CPU worker
    (its OMPProcessManager decides, for one rank without a connector): the worker's
    OpenMP variables set, as the copy thread reads them (copy_cores.py), the forward
    limited to their thread count and this thread pinned to their cores. Called after
    ray.init, so Ray's daemons and the fabric's actors are not pinned with it."""
    from types import SimpleNamespace

    import torch
    from kvfabric.deploy.vllm.connector.copy_cores import omp_cores
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    one_rank = SimpleNamespace(
        parallel_config=SimpleNamespace(
            local_world_size=1, data_parallel_rank_local=None, _api_process_count=1
        ),
        kv_transfer_config=None,
    )
    manager = OMPProcessManager(one_rank)  # type: ignore[arg-type]
    with manager.configure_omp_envs(0, 0):
        worker_env = {
            k: os.environ[k]
            for k in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND")
            if k in os.environ
        }
    cores = omp_cores(worker_env)
    if not cores:
        return  # nobind, or a binding vLLM itself would not make
    os.environ.update(worker_env)
    torch.set_num_threads(len(cores))
    os.sched_setaffinity(0, cores)  # 0: this thread, which runs the forward


def memcpy_s(nbytes: int, repeat: int = 7) -> float:
    """One thread's memcpy of `nbytes` between two buffers of this process: the copies
    run in one thread beside the engine's forward (a torch copy_ here would use every
    core the engine binds, 2-5x faster on this host, and a copy thread doing that would
    take them from the forward)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    to, frm = dst.ctypes.data, src.ctypes.data
    ctypes.memmove(to, frm, nbytes)  # page faults out of the timing
    return median_s(lambda: ctypes.memmove(to, frm, nbytes), repeat)


def with_connector(args: argparse.Namespace, baseline: Baseline) -> dict:
    import ray
    from kvfabric.actors.directory import node_actor_name
    from kvfabric.actors.launch import running, stop
    from kvfabric.actors.served import fabrics_of
    from kvfabric.deploy.vllm.connector import FabricConnector, kv_transfer_config
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt
    from vllm.v1.metrics.reader import Counter

    tokens, pages = args.tokens, args.tokens // BLOCK
    ray.init(
        address="local",  # its own, never a cluster already running here
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        namespace="kvf-bench",
    )
    llm = fab = None
    try:
        here = node_actor_name(ray.get_runtime_context().get_node_id())
        # Room on the node for the prompt and every decoder's save: nothing is evicted.
        room = args.save_runs * pages
        room += args.decoders * (args.stall_tokens // BLOCK + 2) * (2 * args.repeat + 3)
        connector = kv_transfer_config(
            here,
            ray.get_runtime_context().gcs_address,
            device_pages=room,
            host_pages=0,
            swa_device_pages=room,
            swa_host_pages=0,
            staging_pages=pages + args.decoders * (args.stall_tokens // BLOCK + 2) + 64,
            shards=1,
        )
        path = model_path(tokens)
        bind_as_a_vllm_worker()
        llm = LLM(model=path, **engine_args(tokens, connector))
        (namespace,) = fabrics_of(path)
        fab = running(namespace)
        assert fab is not None
        node = fab.nodes[here]
        connector = get_kv_transfer_group()
        assert isinstance(connector, FabricConnector) and connector.worker is not None
        clock = CopyClock(connector.worker)

        def loaded() -> int:
            return sum(
                m.value
                for m in llm.get_metrics()
                if isinstance(m, Counter) and m.name == "vllm:kvfabric_loaded_tokens"
            )

        prompt = TokensPrompt(prompt_token_ids=[(i * 7919) % 250 + 3 for i in range(tokens)])
        short = TokensPrompt(prompt_token_ids=[3, 4, 5])
        one = SamplingParams(temperature=0, max_tokens=1)
        llm.generate([short], one, use_tqdm=False)  # warm-up
        # First, as the engine without the connector does it: after the same warm-up,
        # its runs alternating with the baseline engine's, so that a busy moment of the
        # machine falls on both sides alike.
        for _ in range(WARM_RUNS):  # the decode steps' first runs are slower
            decode_rate(llm, args.decoders, BLOCK - 8)
        ours, theirs = [], []
        for _ in range(args.decode_runs):
            ours.append(decode_rate(llm, args.decoders, BLOCK - 8))
            theirs.append(baseline.decode())
        baseline.stop()
        rate, base_rate = statistics.median(ours), statistics.median(theirs)
        # The prompt computed and saved, then --save-runs - 1 times more, each under a salt
        # of its own (a miss in both caches, saved whole): the worker's save is a median too.
        salts = iter([None] + [uuid.uuid4().hex for _ in range(args.save_runs - 1)])

        def computed() -> None:
            salt = next(salts)
            ids = prompt["prompt_token_ids"]
            item = prompt if salt is None else TokensPrompt(prompt_token_ids=ids, cache_salt=salt)
            llm.generate([item], one, use_tqdm=False)

        uncached_s = median_s(computed, args.save_runs)
        want = (tokens - 1) // BLOCK
        deadline = time.monotonic() + 120
        while ray.get(node.match.remote(prompt["prompt_token_ids"], "default"), timeout=60) < want:
            if time.monotonic() > deadline:
                raise RuntimeError("the prompt was never saved to the node")
            llm.generate([short], one, use_tqdm=False)  # a step
        device_s = median_s(lambda: llm.generate([prompt], one, use_tqdm=False), args.repeat)
        clock.take(to_blocks=True)

        def fabric_hit() -> None:
            reset_prefix_cache(llm)
            before = loaded()
            llm.generate([prompt], one, use_tqdm=False)
            if loaded() - before < want * BLOCK:
                raise RuntimeError("the fabric hit loaded less than the cached prompt")

        fabric_s = median_s(fabric_hit, args.repeat)
        loads, saves = clock.take(to_blocks=True), clock.take(to_blocks=False)
        load = max(loads, key=lambda r: r[1])  # the hits' loads (the warm-up's is tiny)
        save = max(saves, key=lambda r: r[1])  # the prompt's saves (the decoders' are tiny)
        worker_load_s = statistics.median(s for s, b, _ in loads if b == load[1])
        worker_load_cpu_s = statistics.median(cpu for _, b, cpu in loads if b == load[1])
        worker_save_s = statistics.median(s for s, b, _ in saves if b == save[1])
        worker_save_cpu_s = statistics.median(cpu for _, b, cpu in saves if b == save[1])
        # The decoders beside one fabric hit for the long prompt: its node answering at
        # once, then its node stopped for stall_s as the request asks. The same work both
        # ways: what differs is only how long the hit's load waits.
        pid = ray.get(node.__ray_call__.remote(lambda self: os.getpid()), timeout=60)

        def beside_hit(stall_s: float) -> tuple[float, bool]:
            reset_prefix_cache(llm)
            before = loaded()
            if stall_s:
                os.kill(pid, signal.SIGSTOP)
            resume = threading.Timer(stall_s, os.kill, (pid, signal.SIGCONT))
            resume.start()
            try:
                rate = decode_rate(llm, args.decoders, args.stall_tokens, [prompt])
            finally:
                resume.cancel()
                os.kill(pid, signal.SIGCONT)
            return rate, loaded() - before >= want * BLOCK

        prompt_hits: list[bool] = []
        runs = {}
        for stall_s in (0.0, args.stall_s):
            rates = []
            for _ in range(args.repeat):
                beside, hit = beside_hit(stall_s)
                rates.append(beside)
                prompt_hits.append(hit)
            runs[stall_s] = statistics.median(rates)
        unstalled, stalled = runs[0.0], runs[args.stall_s]
        load_memcpy_s, save_memcpy_s = memcpy_s(load[1]), memcpy_s(save[1])
        return {
            "uncached_ttft_s": round(uncached_s, 3),
            "device_hit_ttft_ms": round(device_s * 1e3, 1),
            "fabric_hit_ttft_ms": round(fabric_s * 1e3, 1),
            "ttft_ratio_vs_device_hit": round(fabric_s / device_s, 2),
            "worker_load_ms": round(worker_load_s * 1e3, 2),
            "worker_load_bytes": load[1],
            "worker_load_ratio_vs_memcpy": round(worker_load_s / load_memcpy_s, 2),
            "worker_load_cpu_ratio_vs_memcpy": round(worker_load_cpu_s / load_memcpy_s, 2),
            "worker_save_ms": round(worker_save_s * 1e3, 2),
            "worker_save_bytes": save[1],
            "worker_save_ratio_vs_memcpy": round(worker_save_s / save_memcpy_s, 2),
            "worker_save_cpu_ratio_vs_memcpy": round(worker_save_cpu_s / save_memcpy_s, 2),
            "decode_tok_s": round(rate, 1),
            "decode_no_connector_tok_s": round(base_rate, 1),
            "decode_ratio_vs_no_connector": round(rate / base_rate, 3),
            "stall_s": args.stall_s,
            "decode_beside_load_tok_s": round(unstalled, 1),
            "decode_beside_stalled_load_tok_s": round(stalled, 1),
            "decode_ratio_with_stalled_load": round(stalled / unstalled, 3),
            "stalled_request_hit": all(prompt_hits),
        }
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if fab is not None:
            stop(fab)
        ray.shutdown()


def without_connector(args: argparse.Namespace) -> None:
    """The baseline engine, in a process of its own (vLLM keeps per-process state of its
    connector): one decode run per line "decode" on stdin, its rate printed; "stop" ends."""
    import ray
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # A Ray cluster of its own, idle, as beside the engine with the connector: what differs
    # is the connector and the fabric's actors, not Ray's own daemons.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    bind_as_a_vllm_worker()
    llm = LLM(model=model_path(args.tokens), **engine_args(args.tokens, None))
    try:
        llm.generate([TokensPrompt(prompt_token_ids=[3, 4, 5])], SamplingParams(max_tokens=1))
        for _ in range(WARM_RUNS):  # as with the connector
            decode_rate(llm, args.decoders, BLOCK - 8)
        print(Baseline.READY, flush=True)
        for line in sys.stdin:
            if line.strip() != "decode":
                break
            print(f"{Baseline.RATE} {decode_rate(llm, args.decoders, BLOCK - 8)!r}", flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
        ray.shutdown()


class Baseline:
    """The same engine arguments without the connector, in a child process that decodes
    when asked (without_connector), so both engines' runs can alternate."""

    READY, RATE = "kvf-baseline-ready", "kvf-baseline-rate"

    def __init__(self, args: argparse.Namespace, timeout_s: float = 900) -> None:
        self.timeout_s = timeout_s
        self.log = tempfile.TemporaryFile("w+")  # not a pipe: vLLM's logs could fill one
        cmd = [sys.executable, "-m", "benchmarks.connector_bench", "--no-connector"]
        cmd += ["--tokens", str(args.tokens), "--decoders", str(args.decoders)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        self._expect(self.READY)

    def decode(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("decode\n")
        self.proc.stdin.flush()
        return float(self._expect(self.RATE))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # end of input: it shuts its engine down
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=60)
        self.log.close()

    def _expect(self, tag: str) -> str:
        """The rest of the child's next line that starts with `tag`."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if not ready:
                if self.proc.poll() is not None:
                    break
                continue
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(tag):
                return line[len(tag) :].strip()
        self.proc.kill()
        self.log.seek(0)
        raise RuntimeError(f"the engine without the connector failed:\n{self.log.read()[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench connector", description=__doc__)
    ap.add_argument("--tokens", type=int, default=16384, help="the long prompt's length")
    ap.add_argument("--decoders", type=int, default=16, help="requests decoding at once")
    ap.add_argument("--stall-s", type=float, default=2.0, help="how long the node stops")
    ap.add_argument("--stall-tokens", type=int, default=256, help="decoders' outputs then")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs (the median counts)")
    ap.add_argument(
        "--save-runs", type=int, default=3, help="computed (and saved) runs of the prompt"
    )
    ap.add_argument(
        "--decode-runs", type=int, default=31, help="timed decode runs with nothing to move"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    ap.add_argument("--no-connector", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if (
        args.tokens < 4 * BLOCK
        or min(args.decoders, args.repeat, args.decode_runs, args.save_runs) < 1
        or args.stall_s < 0
    ):
        ap.error(
            f"--tokens must be >= {4 * BLOCK}; --decoders, --repeat, --decode-runs, "
            "--save-runs >= 1"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # both connector sides in this process
    # Both engines bind the same cores (the baseline subprocess inherits this): vLLM
    # reserves one core more for an engine with a KV connector, and with none to spare
    # it binds every core, so on a small host the two would not run the same forward.
    reserve_as_the_stock_engine()
    if args.no_connector:
        without_connector(args)
        return 0
    from benchmarks import staging_bench

    r: dict[str, Any] = {"name": "connector", "tokens": args.tokens}
    baseline = Baseline(args)
    try:
        r.update(with_connector(args, baseline))
    finally:
        baseline.stop()
    node = staging_bench.run(args.tokens, max(args.repeat, 5))
    r["node_load_ms"] = node["node_load_ms"]
    r["node_load_ratio_vs_memcpy"] = node["ratio_vs_memcpy_scattered"]
    r["node_save_ms"] = node["node_save_ms"]
    r["node_save_ratio_vs_memcpy"] = node["save_ratio_vs_memcpy"]
    print(
        f"{r['tokens']}-token prompt: TTFT computed {r['uncached_ttft_s']} s, vLLM device hit "
        f"{r['device_hit_ttft_ms']} ms, fabric hit {r['fabric_hit_ttft_ms']} ms (ratio "
        f"{r['ttft_ratio_vs_device_hit']}); worker copies vs memcpy: load "
        f"{r['worker_load_ratio_vs_memcpy']}, save {r['worker_save_ratio_vs_memcpy']} (CPU time: "
        f"{r['worker_load_cpu_ratio_vs_memcpy']}, {r['worker_save_cpu_ratio_vs_memcpy']}); node "
        f"copies vs memcpy: load {r['node_load_ratio_vs_memcpy']}, save "
        f"{r['node_save_ratio_vs_memcpy']}; decode with nothing to move {r['decode_tok_s']} "
        f"tok/s vs {r['decode_no_connector_tok_s']} without the connector (ratio "
        f"{r['decode_ratio_vs_no_connector']}); decoders beside a load stalled "
        f"{r['stall_s']} s: ratio {r['decode_ratio_with_stalled_load']} (hit: "
        f"{r['stalled_request_hit']})"
    )
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
