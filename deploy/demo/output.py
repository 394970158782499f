"""Where a demo's output goes: Ray's, Serve's and vLLM's log lines to a file, the
report's figure to a PNG."""

from __future__ import annotations

import sys
from pathlib import Path


def send_logs_to(path: Path) -> Path:
    """Ray's, Serve's, vLLM's and the HTTP client's log lines in this process go to `path`,
    not the console, so the demo's own lines stand out (the cluster's processes log to
    Ray's session folder already; Ray's root handler would print every request's line)."""
    import logging

    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("ray", "ray.serve", "ray.llm", "vllm", "transformers", "nixl", "httpx"):
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                logger.removeHandler(h)
        logger.addHandler(handler)
        logger.propagate = False
    return path


def write_plot(
    where: Path, rates: dict, ttfts: dict, title: str = "", tiers: dict | None = None
) -> Path | None:
    from kvfabric.deploy.harness.plots import write_png

    try:
        return write_png(where, rates, ttfts, title, tiers).resolve()
    except OSError as e:
        print(f"could not write the plot to {where}: {e}", file=sys.stderr)
        return None
