"""Synthetic traces in the Mooncake format for the simulator's tests (tests/deploy/test_simulate.py,
tests/deploy/test_replay.py), and the small cluster they run on."""

from __future__ import annotations

import json
from pathlib import Path

from kvfabric.deploy.sim.cluster import SimConfig, prepare
from kvfabric.deploy.sim.trace import BLOCK_TOKENS, TraceRequest
from kvfabric.deploy.sim.workloads import Kind, conversations


def synthetic_trace(
    n: int,
    seed: int = 0,
    *,
    new_per_s: float = 1.0,
    systems: int = 20,
    p_continue: float = 0.7,
    think_median_s: float = 60.0,
    user_tokens: tuple[int, int] = (200, 6000),
) -> list[dict]:
    """Multi-turn conversations under shared system prompts (Zipf-popular), in the Mooncake
    format (`kvfabric.deploy.sim.workloads`)."""
    kind = Kind(
        prefixes=systems,
        prefix_blocks=(1, 8),
        zipf=1.0,
        p_continue=p_continue,
        user_tokens=user_tokens,
        think_median_s=think_median_s,
    )
    return conversations([kind], n, seed, new_per_s)


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def requests_of(rows: list[dict], config: SimConfig):
    return prepare(
        [
            TraceRequest(
                r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"])
            )
            for r in rows
        ],
        config,
    )


SMALL = SimConfig(nodes=4, capacity_tokens=40 * BLOCK_TOKENS, shards=4)


def busy_trace() -> list[dict]:
    """Conversations arriving faster than 4 nodes prefill them: routing must trade load
    against affinity, which is where a global cache pays."""
    return synthetic_trace(400, seed=7, new_per_s=4.0, think_median_s=2.0, user_tokens=(200, 2000))
