"""`kvfabric chaos`: the chaos harness on an embedded cluster (or `--address`).

kvfabric chaos --list                       every fault it can inject
kvfabric chaos --seed 7 --faults 200 --json
kvfabric chaos --kinds kill_shard,event_drop --faults 20
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Iterator

from kvfabric.deploy.cli.cluster import keep_auth_on

from .plan import DESCRIPTIONS, ChaosKind

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
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", type=int, default=50)
    ap.add_argument(
        "--kinds",
        default=",".join(k.value for k in ChaosKind),
        help="comma-separated faults to choose from (see --list)",
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
            print(f"{kind.value:22} {DESCRIPTIONS[kind]}")
        return 0
    if not args.address:
        keep_auth_on()
    log = (lambda m: print(m, file=sys.stderr)) if not args.json else (lambda m: None)
    with session(args.nodes, args.prompts, args.address, log) as harness:
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
        f"leaked pages {report.leaked_pages}, doubly owned {report.double_owned_pages}, overdue "
        "leases "
        f"{report.expired_leases_unreleased}; index converged {report.index_converged_s} s after "
        "the last fault"
    )
    if args.json:
        print(json.dumps(out))
    return 0 if report.ok(args.faults) else 1


@contextlib.contextmanager
def session(
    nodes: int = 3, prompts: int = 12, address: str | None = None, log=lambda _: None
) -> Iterator["ChaosHarness"]:
    """The fabric and its Serve app with chaos on, on an embedded cluster of `nodes`
    (or the cluster at `address`), and a harness over it with trace prompts."""
    from kvfabric.deploy.cli.cluster import connect, free_port, local_cluster, up
    from kvfabric.deploy.cli.http_replay import multi_turn_slice
    from kvfabric.deploy.serve.app import AppArgs
    from kvfabric.deploy.sim.trace import load_trace, request_tokens

    from .harness import ChaosHarness

    app = AppArgs(max_positions=1024, device_pages=512, host_pages=512, chaos=True)
    tokens = [
        request_tokens(r, 16, vocab_size=app.model_config.vocab)[:1000]
        for r in multi_turn_slice(load_trace(), prompts)
    ]
    embedded = local_cluster(nodes) if not address else contextlib.nullcontext(None)
    with embedded as cluster:
        if address:  # no embedded cluster: the given one
            connect(address)
        endpoint = up(dataclasses.asdict(app), port=free_port())
        try:
            yield ChaosHarness(
                endpoint, app.model_name, tokens, cluster=cluster, node_args=NODE_ARGS, log=log
            )
        finally:
            if cluster is not None:
                from ray import serve

                serve.shutdown()
