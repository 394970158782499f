"""`kvfabric demo` with vLLM (the default engine): the same conversations through what
users run today and through the fabric, on one cluster.

1. The stock Ray Serve LLM set-up: `build_openai_app`, vLLM's own prefix cache, Ray's
   `PrefixCacheAffinityRouter`. The conversations go through it twice: once with a fresh
   `cache_salt` per request (nothing cached can match: the reference outputs and the
   uncached TTFT), then as users send them (the baseline).
2. That app is deleted; the fabric starts, and the same engines (same model, same device
   KV cache size, same placement) serve under Ray Serve LLM with the FabricConnector and
   FabricLLMRouter. The conversations go through once more.

Sizes (`kvfabric demo --help`): each engine's own KV cache holds about 2,000 tokens (one
max-length prompt), and six conversations run at once over two engines, so the engines
evict what a next turn needs, as a GPU's KV cache does under load: the baseline
recomputes it, the fabric loads it from the node's pools or another node's. The model
(vllm/serve/model.py, DEMO_SPEC) is sized so that prefill dominates time to first token. Every
measured pass follows warm-up requests (two per engine); the server processes run with
Python's default GC, and the passes are long enough (a minute or more) that no
collection decides a median.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar, cast

from .warm_restart import Restarter, WarmRestart

if TYPE_CHECKING:
    from .conversation import PassResult

T = TypeVar("T")

BASELINE = "ray.serve.llm PrefixCacheAffinityRouter"
TEMPORARY = "temporary"  # `--disk`'s default: a folder made for the run, removed after
ENGINE_CPUS = 2.0  # an engine's bundle: one engine per node
REPORT_WAIT_S = 60.0
DISK_PAGES = 8192  # each node's disk tier: twice its host pool (1 GiB of full-attention pages)


def cpus_per_node(nodes: int) -> int:
    """A simulated node's logical CPUs: its engine's bundle and its node actor, and its
    share of what a cluster runs once (the fabric's directory and index shards, the app's
    ingress). 3 for two nodes or more; 4 for one, where with 3 the node actor found no
    room and the engine's start waited for it until the demo gave up."""
    import math

    from kvfabric.deploy.vllm.connector.jobs import FabricSettings
    from kvfabric.deploy.vllm.serve.app_args import LLMAppArgs
    from kvfabric.deploy.vllm.serve.serve_llm import INGRESS_CPUS

    actor = FabricSettings().node_cpus
    shards = LLMAppArgs.model_fields["shards"].default
    once = actor * (1 + shards) + INGRESS_CPUS
    return math.ceil(ENGINE_CPUS + actor + once / nodes)


def app_args(
    nodes: int, kv_cache_bytes: int, gpu: bool = False, tp: int = 1, disk_folder: str = ""
):
    """The demo's app; with `gpu`, every engine on the one GPU the simulated nodes share;
    `tp`: each engine's tensor-parallel ranks; `disk_folder`: each node's disk tier there
    (DISK_PAGES pages, written through)."""
    from kvfabric.deploy.vllm.serve.app_args import LLMAppArgs
    from kvfabric.deploy.vllm.serve.model import DEMO_SPEC, ensure_tiny_model

    model = ensure_tiny_model(DEMO_SPEC, say=lambda m: print(m, file=sys.stderr))
    app = LLMAppArgs(
        model_dir=str(model),
        model_id="kvfabric-demo-vllm",
        replicas=nodes,
        max_model_len=2048,
        # Per rank: each holds its share of the heads, so the engine holds as many tokens
        # whatever its split.
        kv_cache_bytes=kv_cache_bytes // tp,
        device_pages=256,
        host_pages=4096,
        cpus_per_replica=ENGINE_CPUS,
        tensor_parallel_size=tp,
        dtype="float32",  # the model's own (vLLM's CPU "auto" would compute in bfloat16)
        disk_pages=DISK_PAGES if disk_folder else 0,
        disk_folder=disk_folder,
    )
    return (
        app.but(gpus_per_replica=1.0, gpu_memory_utilization=round(0.8 / nodes, 3)) if gpu else app
    )


def main(args: argparse.Namespace) -> int:
    from kvfabric.deploy.harness.http_replay import conversations

    from .conversation import conversation_texts
    from .trace_file import trace_of

    trace = trace_of(args)
    if trace is None:
        return 2
    convs, n = [], 0
    for turns in conversations(trace):
        if n >= args.requests:
            break
        convs.append(turns[: args.requests - n])
        n += len(convs[-1])
    texts = conversation_texts(convs, args.tokens_per_block, max_prompt_chars(args))

    def run(app) -> tuple[dict, dict, WarmRestart | None]:
        print(
            f"{len(texts)} conversations, {n} requests ({sum(map(len, sum(texts, [])))} prompt "
            f"tokens), {args.concurrency} conversations at a time, {engines(app, args)}",
            file=sys.stderr,
        )
        return run_passes(app, texts, args)

    (passes, fabric_counts, restart), nodes = on_cluster(args, run)
    report = Report.of(passes, fabric_counts, nodes, args.tp)
    report.warm_restart = restart
    plot = _plot(passes, report, args.plot)
    report.print(plot)
    if args.json:
        print(json.dumps(report.as_json()))
    wrong = report.warm_restart.revisit_mismatches if report.warm_restart else 0
    return 1 if report.output_mismatches or report.failed_requests or wrong else 0


def max_prompt_chars(args: argparse.Namespace) -> int:
    """The longest prompt (in characters: tokens) that leaves room for the answer."""
    return 2048 - args.max_tokens - 1


def engines(app, args: argparse.Namespace) -> str:
    return (
        f"on {app.replicas} nodes with one vLLM engine each (own KV cache "
        f"{args.kv_cache_mib} MiB, on {app.device()}, tensor parallel {app.tensor_parallel_size})"
    )


def on_cluster(args: argparse.Namespace, run: Callable[[Any], T]) -> tuple[T, int]:
    """`run(app)` on the demo's cluster (embedded, or `--address`'s) with the demo's app
    for its nodes; returns its result and the node count. The embedded cluster's Serve
    apps are shut down after."""
    from kvfabric.deploy.harness.cluster import connect, local_cluster

    if args.address:
        connect(args.address)
    cm = (
        local_cluster(
            args.nodes, cpus_per_node=cpus_per_node(args.nodes), gpus_per_node=int(args.gpu)
        )
        if not args.address
        else contextlib.nullcontext()
    )
    with cm:
        import ray

        # vLLM's loggers exist from its import on
        from kvfabric.deploy.vllm.serve import serve_llm  # noqa: F401

        from .output import send_logs_to

        log = send_logs_to(Path(args.log))
        print(f"Ray, Serve and vLLM logs: {log}", file=sys.stderr)
        nodes = sum(1 for node in ray.nodes() if node["Alive"])
        with disk_folder(args) as folder:
            app = app_args(nodes, args.kv_cache_mib << 20, args.gpu, args.tp, folder)
            try:
                return run(app), nodes
            finally:
                if not args.address:
                    from ray import serve

                    serve.shutdown()


@contextlib.contextmanager
def disk_folder(args: argparse.Namespace) -> Iterator[str]:
    """`--disk`'s folder ("" without it): a temporary one on the embedded cluster, removed
    after; on an existing cluster, the path given."""
    if not args.disk:
        yield ""
    elif args.disk != TEMPORARY:
        yield args.disk
    else:
        with tempfile.TemporaryDirectory(prefix="kvfabric-demo-disk-") as folder:
            yield folder


def start_baseline(app, port: int):
    """The stock Ray Serve LLM app on `app`'s engines, warmed up; returns its endpoint."""
    from kvfabric.deploy.harness.cluster import serve_app
    from kvfabric.deploy.vllm.serve.serve_llm import build_baseline_app

    print(
        f"starting the stock Ray Serve LLM app ({BASELINE}, vLLM's own prefix cache) ...",
        file=sys.stderr,
    )
    started = time.monotonic()
    endpoint = serve_app(build_baseline_app(app), "/v1/models", port=port, wait_s=600.0)
    print(f"  up in {time.monotonic() - started:.0f} s", file=sys.stderr)
    warm_up(endpoint, app)
    return endpoint


def start_fabric(app, port: int):
    """The fabric and its Ray Serve LLM app on `app`'s engines (the stock app deleted
    first), warmed up; returns its endpoint and the warm-up requests sent."""
    from kvfabric.deploy.harness.cluster import APP_NAME, up
    from ray import serve

    serve.delete(APP_NAME)
    print(
        "starting the fabric and its Ray Serve LLM app (FabricConnector, FabricLLMRouter) ...",
        file=sys.stderr,
    )
    started = time.monotonic()
    endpoint = up(app.as_dict(), port=port, engine="vllm", wait_s=600.0)
    print(f"  up in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return endpoint, warm_up(endpoint, app)


def run_passes(
    app, texts: list[list[str]], args: argparse.Namespace
) -> tuple[dict, dict, WarmRestart | None]:
    from kvfabric.deploy.harness.cluster import free_port

    from .conversation import replay_conversations

    port = free_port()

    def go(name: str, endpoint, **kw):
        return replay_conversations(
            name, endpoint, app.model_id, texts, args.max_tokens, args.concurrency, **kw
        )

    endpoint = start_baseline(app, port)
    passes = {"caching off": go("nocache", endpoint, uncached=True)}
    passes["baseline"] = go("baseline", endpoint)
    endpoint, warmups = start_fabric(app, port)
    restarter = Restarter(app.model_id, args.restart_after) if args.restart_after else None
    passes["fabric"], counts = counted(
        app, warmups, lambda: go("fabric", endpoint, on_done=restarter)
    )
    if restarter is None:
        return passes, counts, None
    restart = restarter.report(passes["fabric"])
    if restart is None:
        print(f"  no warm-restart figure: {restarter.error}", file=sys.stderr)
        return passes, counts, None
    # The requests before the restart, again: what they stored before it is found only
    # where the restarted nodes adopted it from disk.
    again = [[texts[c][k]] for c, k in restart.before]
    revisit = replay_conversations(
        "revisit", endpoint, app.model_id, again, args.max_tokens, args.concurrency
    )
    return passes, counts, restart.revisited(revisit, passes["caching off"].outputs())


def counted(app, warmups: int, go: Callable[[], PassResult]) -> tuple[PassResult, dict]:
    """The fabric's pass `go()` with what the engines' connectors and Ray's object
    stores did during it (`warmups`: the requests the engines finished before)."""
    before = fabric_counters(app.model_id, warmups)
    store_before = object_store_created_bytes()
    result = go()
    after = fabric_counters(app.model_id, warmups + len(result.turns))
    store_after = object_store_created_bytes()
    counts: dict[str, int | None] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print(
        "  the engines' connectors: " + ", ".join(f"{k} {v}" for k, v in counts.items()),
        file=sys.stderr,
    )
    counts["object_store_bytes"] = (
        None if store_before is None or store_after is None else store_after - store_before
    )
    return result, counts


def warm_up(endpoint, app) -> int:
    """Short uncached requests, two an engine at once, so the measured passes find every
    engine's code paths loaded; returns how many were sent."""
    from .conversation import replay_conversations

    n = 2 * app.replicas
    result = replay_conversations(
        "warm-up",
        endpoint,
        app.model_id,
        [["warm up " * 40]] * n,
        2,
        n,
        uncached=True,
        progress=False,
    )
    for t in result.turns:
        if t.error:  # the measured passes count their own failures
            print(f"  warm-up request failed: {t.error}", file=sys.stderr)
    return n


def fabric_counters(model_id: str, finished: int) -> dict[str, int]:
    """The engines' connector counters summed over every node of their fabric
    (engine_reports), once they account for `finished` requests (reports are sent as
    requests finish)."""
    import ray
    from kvfabric.actors.directory import CALL_TIMEOUT_S, DIRECTORY
    from kvfabric.actors.served import fabrics_of

    deadline = time.monotonic() + REPORT_WAIT_S
    while True:
        actors: list = []
        for namespace in fabrics_of(model_id):
            directory = ray.get_actor(DIRECTORY, namespace=namespace)
            names = cast(list[str], ray.get(directory.node_names.remote(), timeout=CALL_TIMEOUT_S))
            actors += [ray.get_actor(name, namespace=namespace) for name in names]
        reports = [
            r
            for a in actors
            for r in ray.get(a.engine_reports.remote(), timeout=CALL_TIMEOUT_S).values()
        ]
        total: dict[str, int] = {}
        for r in reports:
            for k, v in r.items():
                if isinstance(v, int):
                    total[k] = total.get(k, 0) + v
        total["nixl_bytes"] = sum(
            ray.get(a.stats.remote(), timeout=CALL_TIMEOUT_S)["fetched_bytes"] for a in actors
        )
        if total.get("finished_requests", 0) >= finished or time.monotonic() > deadline:
            return total
        time.sleep(0.2)


def object_store_created_bytes() -> int | None:
    """Bytes ever created in the cluster's object stores (Ray's store stats); None when
    Ray cannot say."""
    try:
        import ray
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
        return int(reply.store_stats.cumulative_created_bytes)
    except Exception as e:  # a private API: its absence costs the figure, not the demo
        print(f"  the object store's counters are not readable: {e!r}", file=sys.stderr)
        return None


@dataclasses.dataclass
class Report:
    requests: int
    nodes: int
    failed_requests: int
    output_mismatches: int
    baseline_output_mismatches: int
    prompt_tokens: int
    cached_tokens: int
    host_hit_tokens: int
    remote_hit_tokens: int
    nixl_bytes: int
    object_store_bytes: int | None
    ttft_p50_ms: float
    ttft_p99_ms: float
    baseline_ttft_p50_ms: float
    baseline_ttft_p99_ms: float
    baseline_hit_rate: float
    nocache_ttft_p50_ms: float
    wall_s: dict[str, float]
    first_errors: dict[str, str]
    tensor_parallel_size: int = 1
    warm_restart: WarmRestart | None = None

    @classmethod
    def of(cls, passes: dict, counts: dict, nodes: int, tp: int = 1) -> "Report":
        ref = passes["caching off"].outputs()
        fabric, base = passes["fabric"], passes["baseline"]

        def mismatches(p) -> int:
            """Requests whose greedy tokens differ from caching off (a failed one has none)."""
            out = p.outputs()
            return sum(1 for k, v in ref.items() if out.get(k) != v)

        return cls(
            requests=len(fabric.turns),
            nodes=nodes,
            failed_requests=sum(p.failed for p in passes.values()),
            output_mismatches=mismatches(fabric),
            baseline_output_mismatches=mismatches(base),
            prompt_tokens=fabric.prompt_tokens,
            cached_tokens=fabric.cached_tokens,
            host_hit_tokens=counts.get("loaded_tokens", 0) - counts.get("remote_loaded_tokens", 0),
            remote_hit_tokens=counts.get("remote_loaded_tokens", 0),
            nixl_bytes=counts.get("nixl_bytes", 0),
            object_store_bytes=counts.get("object_store_bytes"),
            ttft_p50_ms=fabric.ttft_ms(0.5),
            ttft_p99_ms=fabric.ttft_ms(0.99),
            baseline_ttft_p50_ms=base.ttft_ms(0.5),
            baseline_ttft_p99_ms=base.ttft_ms(0.99),
            baseline_hit_rate=base.cached_tokens / max(1, base.prompt_tokens),
            nocache_ttft_p50_ms=passes["caching off"].ttft_ms(0.5),
            wall_s={k: round(p.wall_s, 1) for k, p in passes.items()},
            first_errors={
                k: p.turns[i].error
                for k, p in passes.items()
                for i in [next((i for i, t in enumerate(p.turns) if t.error), -1)]
                if i >= 0
            },
            tensor_parallel_size=tp,
        )

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def device_hit_tokens(self) -> int:
        return self.cached_tokens - self.host_hit_tokens - self.remote_hit_tokens

    @property
    def ratio(self) -> float:
        return (
            self.ttft_p50_ms / self.baseline_ttft_p50_ms
            if self.baseline_ttft_p50_ms
            else float("nan")
        )

    def print(self, plot: Path | None) -> None:
        pct = 100 / max(1, self.prompt_tokens)
        for name, error in self.first_errors.items():
            print(f"{name}: a request failed: {error}")
        print(
            f"requests {self.requests} a pass ({self.failed_requests} failed in all) on "
            f"{self.nodes} nodes; "
            f"greedy outputs differing from caching off: fabric {self.output_mismatches}, "
            f"baseline {self.baseline_output_mismatches}"
        )
        print(
            f"fabric hit rate {self.hit_rate:.1%}: engine's own cache "
            f"{self.device_hit_tokens * pct:.1f}%, "
            f"node's pools {self.host_hit_tokens * pct:.1f}%, other nodes "
            f"{self.remote_hit_tokens * pct:.1f}% "
            f"of {self.prompt_tokens} prompt tokens; baseline hit rate {self.baseline_hit_rate:.1%}"
        )
        store = (
            "unknown"
            if self.object_store_bytes is None
            else f"{self.object_store_bytes / 2**20:.1f} MiB"
        )
        since = " (since the restart: node actors' counters restart with them)"
        print(
            f"NIXL moved {self.nixl_bytes / 2**20:.1f} MiB between nodes"
            f"{since if self.warm_restart else ''}; the object store took {store} "
            f"during the fabric's pass (all objects, K/V or not)"
        )
        print(
            f"TTFT p50 {self.ttft_p50_ms:.0f} ms / p99 {self.ttft_p99_ms:.0f} ms with the fabric; "
            f"{self.baseline_ttft_p50_ms:.0f} / {self.baseline_ttft_p99_ms:.0f} ms with "
            f"{BASELINE}; "
            f"{self.nocache_ttft_p50_ms:.0f} ms p50 uncached (ratio to the baseline "
            f"{self.ratio:.2f}, target <= 0.7)"
        )
        if self.warm_restart is not None:
            print(self.warm_restart.line())
        if plot:
            print(f"plot: {plot}")

    def as_json(self) -> dict:
        return {
            "engine": "vllm",
            "requests": self.requests,
            "nodes": self.nodes,
            "tensor_parallel_size": self.tensor_parallel_size,
            "output_mismatches": self.output_mismatches,
            "hit_rate": round(self.hit_rate, 4),
            "device_hit_tokens": self.device_hit_tokens,
            "host_hit_tokens": self.host_hit_tokens,
            "remote_hit_tokens": self.remote_hit_tokens,
            "nixl_bytes": self.nixl_bytes,
            "object_store_kv_bytes": self.object_store_bytes,
            "ttft_p50_ms": round(self.ttft_p50_ms, 1),
            "baseline": BASELINE,
            "baseline_ttft_p50_ms": round(self.baseline_ttft_p50_ms, 1),
            "ttft_ratio_vs_baseline": round(self.ratio, 3),
            "baseline_output_mismatches": self.baseline_output_mismatches,
            "baseline_hit_rate": round(self.baseline_hit_rate, 4),
            "failed_requests": self.failed_requests,
            "prompt_tokens": self.prompt_tokens,
            "nocache_ttft_p50_ms": round(self.nocache_ttft_p50_ms, 1),
            "wall_s": self.wall_s,
            "warm_restart": None if self.warm_restart is None else self.warm_restart.as_json(),
        }


def _plot(passes: dict, report: "Report", where: str) -> Path | None:
    from kvfabric.deploy.harness.plots import cumulative_rate

    from .output import write_plot

    rates = {
        name: cumulative_rate([t.cached_tokens for t in p.done], [t.prompt_tokens for t in p.done])
        for name, p in passes.items()
    }
    ttfts = {name: [t.ttft_ms for t in p.done] for name, p in passes.items()}
    tiers = {}
    for name, p in passes.items():
        prompt = sum(t.prompt_tokens for t in p.done)
        cached = sum(t.cached_tokens for t in p.done)
        tiers[name] = {"engine's cache": cached, "computed": prompt - cached}
    tiers["fabric"] = {
        "engine's cache": report.device_hit_tokens,
        "node's pools": report.host_hit_tokens,
        "other nodes": report.remote_hit_tokens,
        "computed": report.prompt_tokens - report.cached_tokens,
    }
    done = max((len(p.done) for p in passes.values()), default=0)
    title = f"kvfabric demo, vLLM: {done} requests a pass, the fabric vs {BASELINE}"
    return write_plot(Path(where), rates, ttfts, title, tiers)
