"""The `kvfabric` command."""
from __future__ import annotations

import argparse
import importlib
import sys

BENCHES = {"radix": "benchmarks.radix_bench", "transport": "benchmarks.transport_bench",
           "index": "benchmarks.index_bench"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="kvfabric", description="Cluster-wide KV-cache fabric on Ray.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="replay a trace slice through the cache and check every hit", add_help=False)
    bench = sub.add_parser("bench", help="benchmarks against peers and limits", add_help=False)
    bench.add_argument("name", choices=sorted(BENCHES))
    args, rest = ap.parse_known_args(argv)
    if args.command == "demo":
        from deploy.demo import main as demo
        return demo(rest)
    # Benchmarks live beside the package layers; import them only when asked.
    return importlib.import_module(BENCHES[args.name]).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
