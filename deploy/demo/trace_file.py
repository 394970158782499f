"""The trace a demo replays: `--trace`'s file, read, or why it cannot be."""

from __future__ import annotations

import argparse
import sys

from kvfabric.deploy.sim.trace import TraceError, load_trace


def trace_of(args: argparse.Namespace) -> list | None:
    """The demo's trace; None (said on stderr) when it cannot be read."""
    try:
        return load_trace(args.trace)
    except (TraceError, OSError) as e:
        print(f"kvfabric demo: {e}", file=sys.stderr)
        return None
