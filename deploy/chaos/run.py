"""`kvfabric chaos`: the chaos harness on an embedded cluster (or `--address`).

kvfabric chaos --list                       every fault it can inject
kvfabric chaos --seed 7 --faults 200 --json
kvfabric chaos --kinds kill_shard,event_drop --faults 20
kvfabric chaos --engine vllm --seed 7 --faults 100 --json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Iterator

from kvfabric.deploy.harness.cluster import keep_auth_on

from .plan import DESCRIPTIONS, ENGINE_KINDS, ChaosKind

if TYPE_CHECKING:
    from .harness import ChaosHarness

NODE_ARGS = {"num_cpus": 2, "object_store_memory": 256 * 1024**2}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="kvfabric chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--list", action="store_true", help="list the faults and exit")
    ap.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="an existing cluster whose fabric runs with chaos on (default: an embedded one)",
    )
    ap.add_argument(
        "--engine",
        choices=sorted(ENGINE_KINDS),
        default="reference",
        help="the app's engines: the reference model, or vLLM under Ray Serve LLM "
        "(an embedded cluster only)",
    )
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", type=int, default=50)
    ap.add_argument(
        "--kinds",
        default="",
        help="comma-separated faults to choose from (see --list); default: all the engine's",
    )
    ap.add_argument("--interval-s", type=float, default=0.3, help="time between faults")
    ap.add_argument("--quiet-s", type=float, default=3.0, help="quiet period after the last fault")
    ap.add_argument("--threads", type=int, default=2, help="request streams during the run")
    ap.add_argument(
        "--prompts", type=int, default=12, help="trace prompts the workload cycles through"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.kinds = [ChaosKind(k.strip()) for k in args.kinds.split(",") if k.strip()]
    except ValueError as e:
        ap.error(f"--kinds: {e}; see --list")
    allowed = ENGINE_KINDS[args.engine]
    args.kinds = args.kinds or list(allowed)
    wrong = [k.value for k in args.kinds if k not in allowed]
    if wrong:
        ap.error(f"--kinds: {', '.join(wrong)} cannot be injected with --engine {args.engine}")
    if args.engine == "vllm" and args.address:
        ap.error("--engine vllm runs on an embedded cluster (its faults signal local processes)")
    for name in ("nodes", "faults", "threads", "prompts"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be positive")
    if not args.kinds or args.interval_s < 0 or args.quiet_s < 0:
        ap.error("--kinds must name a fault; --interval-s and --quiet-s must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list:
        for kind in ChaosKind:
            engines = [e for e, kinds in ENGINE_KINDS.items() if kind in kinds]
            print(f"{kind.value:30} {DESCRIPTIONS[kind]} ({', '.join(engines)})")
        return 0
    if not args.address:
        keep_auth_on()
    started = session if args.engine == "reference" else vllm_session
    with started(args.nodes, args.prompts, args.address, _log) as harness:
        report = harness.run(
            args.seed, args.faults, args.kinds, args.interval_s, args.quiet_s, args.threads
        )
    out = dataclasses.asdict(report)
    print(
        f"faults injected {report.faults_injected} of {args.faults} in {report.fault_attempts} "
        "tries "
        f"({report.by_kind}); {report.wall_s} s"
    )
    print(
        f"requests {report.requests}, failed {report.failed_requests}, retried by the client "
        f"{report.retried_requests}, by the app {report.app_retried_requests}, wrong outputs "
        f"{report.wrong_outputs}"
    )
    print(
        f"leaked pages {report.leaked_pages}, doubly owned {report.double_owned_pages}, "
        f"leaked staging files {report.leaked_staging_files}, overdue leases "
        f"{report.expired_leases_unreleased}; index converged {report.index_converged_s} s after "
        f"the last fault (the workload's requests ended {report.workload_drained_s} s after it)"
    )
    if args.json:
        print(json.dumps(out))
    return 0 if report.ok(args.faults) else 1


def _log(message: str) -> None:
    """Progress on stderr (stdout carries the results, and the JSON line)."""
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def session(
    nodes: int = 3, prompts: int = 12, address: str | None = None, log=lambda _: None
) -> Iterator["ChaosHarness"]:
    """The fabric and its Serve app with chaos on, on an embedded cluster of `nodes`
    (or the cluster at `address`), and a harness over it with trace prompts."""
    from kvfabric.core.cache.tiers import WritePolicy
    from kvfabric.deploy.harness.cluster import connect, free_port, local_cluster, up
    from kvfabric.deploy.harness.http_replay import multi_turn_slice
    from kvfabric.deploy.reference.serve.app import AppArgs
    from kvfabric.deploy.sim.trace import load_trace, request_tokens

    from .harness import ChaosHarness

    # On an embedded cluster each node has a disk tier, written through (the disk faults
    # act on its writes), in a folder of the run's own; a given cluster's nodes may not
    # share this machine's folders: none there.
    embedded = local_cluster(nodes) if not address else contextlib.nullcontext(None)
    folder = tempfile.TemporaryDirectory(prefix="kvf-chaos-disk-") if not address else None
    with folder or contextlib.nullcontext(), embedded as cluster:
        app = AppArgs(max_positions=1024, device_pages=512, host_pages=512, chaos=True)
        if folder is not None:
            app = app.but(
                disk_pages=1024, disk_folder=folder.name, disk_write=WritePolicy.WRITE_THROUGH
            )
        tokens = [
            request_tokens(r, 16, vocab_size=app.reference_model.vocab)[:1000]
            for r in multi_turn_slice(load_trace(), prompts)
        ]
        if address:  # no embedded cluster: the given one
            connect(address)
        endpoint = up(app.as_dict(), port=free_port())
        try:
            yield ChaosHarness(
                endpoint, app.model_name, tokens, cluster=cluster, node_args=NODE_ARGS, log=log
            )
        finally:
            if cluster is not None:
                from ray import serve

                serve.shutdown()


@contextlib.contextmanager
def vllm_session(
    nodes: int = 3, prompts: int = 12, address: str | None = None, log=lambda _: None
) -> Iterator["ChaosHarness"]:
    """The vLLM app (one engine a node, the FabricConnector in each, chaos on) on an
    embedded cluster of `nodes`, and a harness over it with trace prompts as token ids."""
    from kvfabric.deploy.harness.cluster import free_port, local_cluster, up
    from kvfabric.deploy.vllm.serve.app_args import LLMAppArgs

    from .vllm_harness import orphans, remove_orphans

    if address:
        raise ValueError("--engine vllm runs on an embedded cluster")
    # Each node has a disk tier, written through (the disk faults act on its writes: an
    # engine's every save), in a folder of the run's own, as the reference run's nodes do.
    with tempfile.TemporaryDirectory(prefix="kvf-chaos-") as tmp:
        chaos_file = os.path.join(tmp, "steps.json")
        app = LLMAppArgs(
            replicas=nodes,
            device_pages=64,
            host_pages=2048,
            disk_pages=4096,
            disk_folder=os.path.join(tmp, "disk"),
            disk_write="write_through",
            cpus_per_replica=2.0,
            chaos_file=chaos_file,
        )
        earlier = orphans()
        # An engine's bundle takes 2 of a node's 3 CPUs, the fabric's actors the rest.
        with local_cluster(nodes, cpus_per_node=3):
            from ray import serve

            try:
                endpoint = up(app.as_dict(), port=free_port(), engine="vllm", wait_s=900)
                yield vllm_harness(
                    endpoint,
                    app.model_id,
                    str(app.model()),
                    prompts,
                    app.max_model_len,
                    chaos_file=chaos_file,
                    engine_cache_bytes=app.kv_cache_bytes,
                    log=log,
                )
            finally:
                serve.shutdown()
        remove_orphans(keep=earlier)


def vllm_harness(
    endpoint,
    model_id: str,
    model_dir: str,
    prompts: int,
    max_model_len: int,
    *,
    chaos_file: str,
    engine_cache_bytes: int,
    log=lambda _: None,
) -> "ChaosHarness":
    """A harness over a running vLLM app whose engines were given the chaos settings
    (LLMAppArgs.chaos_file; or `with_fabric(..., **chaos_settings(chaos_file))`), with
    `prompts` trace prompts as token ids, once the engines announced their fabric."""
    import time

    from kvfabric.actors.served import fabrics_of
    from kvfabric.deploy.harness.http_replay import multi_turn_slice
    from kvfabric.deploy.sim.trace import load_trace, request_tokens
    from kvfabric.deploy.vllm.serve.llm_router import OpenAIPrompts

    from .vllm_harness import VllmChaosHarness

    vocab = OpenAIPrompts()
    vocab.load_tokenizer(model_dir)
    size = len(vocab.tokenizer)
    tokens = [
        request_tokens(r, 32, vocab_size=size)[: max_model_len // 2]
        for r in multi_turn_slice(load_trace(), prompts)
    ]
    deadline = time.monotonic() + 120
    while not fabrics_of(model_id) and time.monotonic() < deadline:
        time.sleep(0.5)  # the engines announce the fabric they started
    (ray_namespace,) = fabrics_of(model_id)
    return VllmChaosHarness(
        endpoint,
        model_id,
        tokens,
        cluster=None,  # removing a Ray node would take an engine's bundle
        log=log,
        ray_namespace=ray_namespace,
        chaos_file=chaos_file,
        engine_cache_bytes=engine_cache_bytes,
    )


def chaos_settings(chaos_file: str) -> dict:
    """The FabricConnector settings that turn chaos on in a user's own config
    (`with_fabric(config, **chaos_settings(path))`): the node actors' hooks and the
    engines' step-fault file, as LLMAppArgs.chaos_file gives the CLI's app."""
    from kvfabric.deploy.serving.injectors import registered

    return registered().connector_settings(chaos_file)
