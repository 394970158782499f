"""`kvfabric demo`: the fabric and its Serve app on a cluster, fed multi-turn
conversations of a real trace through the OpenAI endpoint.

With no address it starts an embedded local Ray cluster of simulated nodes on this
machine; with `--address` (or RAY_ADDRESS) it uses that cluster.
- `--engine vllm` (default): vLLM engines under Ray Serve LLM, first as users run them
  today (vLLM's prefix cache, Ray's PrefixCacheAffinityRouter), then with the fabric as
  their KV layer; outputs are checked against a pass with caching off (deploy/demo/vllm.py).
  With `--rate R` (or `--rate auto`): open-loop load instead, single-turn requests that
  share no prefix arriving at R a second, the stock app against the fabric's; the report
  gives throughput and TPOT ratios (deploy/demo/load.py).
- `--engine reference`: the reference model's app; each request is sent twice, caching
  off and through the fabric, outputs compared bit for bit.
The report gives hit rates by tier, bytes moved, TTFT and output mismatches; a PNG too.
With `--disk`, each node has a disk tier and every node actor is restarted mid-pass: the
report compares the hit rate of the requests after the restart with those before
(deploy/demo/warm_restart.py).
"""

from __future__ import annotations

import argparse
import os

from kvfabric.deploy.demo.vllm import TEMPORARY
from kvfabric.deploy.harness.cluster import keep_auth_on

DEFAULT_PLOT = "kvfabric-demo.png"
DEFAULT_LOG = "kvfabric-demo.log"


# Per engine: (nodes, requests, tokens per trace block, max tokens, concurrency).
DEFAULTS = {"reference": (3, 120, 64, 4, 3), "vllm": (2, 60, 32, 8, 6)}
# Tokens a request under --rate: enough decode steps that TPOT is a median of many.
LOAD_MAX_TOKENS = 32


def rate(text: str) -> float | str:
    """--rate's value: requests a second (> 0), or "auto"."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or auto: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive and finite: {text!r}")
    return value


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="kvfabric demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--engine",
        choices=tuple(DEFAULTS),
        default="vllm",
        help="vllm: vLLM under Ray Serve LLM against the stock set-up (default); "
        "reference: the bit-exact reference model against caching off",
    )
    ap.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="an existing Ray cluster (default: RAY_ADDRESS, else an embedded one)",
    )
    ap.add_argument(
        "--nodes", type=int, help="simulated nodes of the embedded cluster (vllm 2, reference 3)"
    )
    ap.add_argument(
        "--trace", default=None, help="a Mooncake-format JSONL trace (default: the packaged one)"
    )
    ap.add_argument("--requests", type=int, help="requests a pass (vllm 60, reference 120)")
    ap.add_argument(
        "--tokens-per-block",
        type=int,
        help="prompt tokens per trace hash block (the trace's are 512; vllm 32, reference 64)",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        help=f"tokens generated a request (vllm 8, with --rate {LOAD_MAX_TOKENS}; reference 4)",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        help="requests (vllm: conversations) at once (vllm 6, reference 3); with --rate auto, "
        "the capacity probe's",
    )
    ap.add_argument(
        "--rate",
        type=rate,
        help="vllm: open-loop load of single-turn requests sharing no prefix, this many a "
        "second (Poisson arrivals), the stock app against the fabric's; auto: 0.9 of the "
        "stock app's capacity, measured first closed loop",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="with --rate: the arrival schedule's seed (0)"
    )
    ap.add_argument(
        "--kv-cache-mib",
        type=int,
        default=17,
        help="vllm: each engine's own KV cache (17: about 2,000 tokens, one max-length prompt)",
    )
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="vllm: engines on CUDA, every simulated node given this machine's GPU 0 "
        "(they share it; each engine may take 0.8/nodes of its memory)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="vllm: each engine's tensor-parallel ranks (on CPU one core each)",
    )
    ap.add_argument(
        "--disk",
        nargs="?",
        const=TEMPORARY,
        default="",
        metavar="FOLDER",
        help="vllm: give each node a disk tier (written through), in FOLDER (an absolute path "
        "on every node; default: a temporary folder on the embedded cluster), and restart "
        "every node actor mid-pass: the report compares the hit rate after it with before",
    )
    ap.add_argument(
        "--restart-after",
        type=int,
        help="vllm: restart every node actor once this many of the fabric's requests have "
        "finished (with --disk: half of --requests; without, the nodes come back cold)",
    )
    ap.add_argument("--plot", default=DEFAULT_PLOT, help="where to write the PNG (not with --rate)")
    ap.add_argument(
        "--log",
        default=DEFAULT_LOG,
        help="where Ray's, Serve's and vLLM's log lines go (the console keeps the demo's own)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    if args.rate is not None and args.engine != "vllm":
        ap.error("--rate is for the vllm engine")
    if args.rate is not None and args.max_tokens is None:
        args.max_tokens = LOAD_MAX_TOKENS
    names = ("nodes", "requests", "tokens_per_block", "max_tokens", "concurrency")
    for name, default in zip(names, DEFAULTS[args.engine]):
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in names + ("kv_cache_mib", "tp"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.gpu and (args.engine != "vllm" or args.address):
        ap.error("--gpu is for the vllm engine on the embedded cluster")
    if args.tp > 1 and args.engine != "vllm":
        ap.error("--tp is for the vllm engine")
    _check_restart(ap, args)
    return args


def _check_restart(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if (args.disk or args.restart_after is not None) and (
        args.engine != "vllm" or args.rate is not None
    ):
        ap.error("--disk and --restart-after are for the vllm engine's conversations")
    if args.disk == TEMPORARY and args.address:
        ap.error("--disk on an existing cluster needs a FOLDER every node has")
    if args.disk and args.disk != TEMPORARY and not os.path.isabs(args.disk):
        ap.error(f"--disk FOLDER must be an absolute path, got {args.disk!r}")
    if args.restart_after is None:
        args.restart_after = args.requests // 2 if args.disk else 0
    elif not 0 < args.restart_after < args.requests:
        ap.error(f"--restart-after must be between 1 and --requests - 1 ({args.requests - 1})")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.address:
        keep_auth_on()
    if args.engine == "vllm":
        if args.rate is not None:
            from kvfabric.deploy.demo.load import main as load_demo

            return load_demo(args)
        from kvfabric.deploy.demo.vllm import main as vllm_demo

        return vllm_demo(args)
    from kvfabric.deploy.demo.reference import main as reference_demo

    return reference_demo(args)
