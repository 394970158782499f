"""What the chaos harness can inject, and a seeded schedule of it (no Ray here,
so that `kvfabric chaos --list` and argument checks answer at once)."""

from __future__ import annotations

import random
from enum import Enum
from typing import Sequence


class ChaosKind(str, Enum):
    KILL_NODE_ACTOR = "kill_node_actor"
    REMOVE_READD_NODE = "remove_readd_node"
    KILL_SHARD = "kill_shard"
    TRANSFER_FAIL_AFTER = "transfer_fail_after"
    TRANSFER_HANG = "transfer_hang"
    TRANSFER_CORRUPT = "transfer_corrupt"
    SLOW_PEER = "slow_peer"
    ALLOC_FAIL = "alloc_fail"
    EVENT_DROP = "event_drop"
    EVENT_DUPLICATE = "event_duplicate"
    EVENT_REORDER = "event_reorder"
    CROSS_FETCH = "cross_fetch"
    EVICT_MID_REQUEST = "evict_mid_request"
    KILL_DIRECTORY_MID_REBALANCE = "kill_directory_mid_rebalance"
    # vLLM engines (`--engine vllm`) only:
    WORKER_KILL_MID_LOAD = "worker_kill_mid_load"
    WORKER_KILL_MID_SAVE = "worker_kill_mid_save"
    NODE_KILL_MID_LOAD = "node_kill_mid_load"
    NODE_STALL = "node_stall"
    SHM_FULL = "shm_full"
    # Nodes with a disk tier (those of both harnesses' embedded clusters have one):
    DISK_KILL_MID_WRITE = "disk_kill_mid_write"
    DISK_CORRUPT_PAGE = "disk_corrupt_page"
    DISK_FULL = "disk_full"


DESCRIPTIONS = {
    ChaosKind.KILL_NODE_ACTOR: (
        "kill a node cache actor; Ray restarts it (new epoch) and the directory rejoins it"
    ),
    ChaosKind.REMOVE_READD_NODE: (
        "remove a Ray worker node, then add one back (embedded cluster only)"
    ),
    ChaosKind.KILL_SHARD: "kill an index shard actor; it restarts empty and the nodes refill it",
    ChaosKind.TRANSFER_FAIL_AFTER: "a fetch's read fails after k pages were written",
    ChaosKind.TRANSFER_HANG: (
        "a fetch's read is not done by its deadline: given up, its pages held until it ends"
    ),
    ChaosKind.TRANSFER_CORRUPT: (
        "a fetch's read completes with a flipped byte: checksums must catch it"
    ),
    ChaosKind.SLOW_PEER: "a fetch's read completes late (within the deadline)",
    ChaosKind.ALLOC_FAIL: "one of a node's next reservation points fails",
    ChaosKind.EVENT_DROP: "a node's next KV event batches are lost",
    ChaosKind.EVENT_DUPLICATE: "a node's next KV event batches arrive twice",
    ChaosKind.EVENT_REORDER: "a node's next KV event batches arrive after later ones",
    ChaosKind.CROSS_FETCH: "two nodes fetch from each other at the same time",
    ChaosKind.EVICT_MID_REQUEST: "a node evicts all it can between a request's match and its put",
    ChaosKind.KILL_DIRECTORY_MID_REBALANCE: (
        "the directory is killed while it moves the route table"
    ),
    ChaosKind.WORKER_KILL_MID_LOAD: (
        "a vLLM worker is killed (-9) as it copies a load from staging; Serve restarts it"
    ),
    ChaosKind.WORKER_KILL_MID_SAVE: (
        "a vLLM worker is killed (-9) as it copies a save to staging; Serve restarts it"
    ),
    ChaosKind.NODE_KILL_MID_LOAD: (
        "a node actor is killed (-9) with an engine's load staged, before it answers"
    ),
    ChaosKind.NODE_STALL: "a node actor stops (SIGSTOP) past the engines' call deadline",
    ChaosKind.SHM_FULL: (
        "a vLLM worker is killed (-9); /dev/shm is full as its replacement reserves its "
        "staging, so that start fails; Serve's next one starts"
    ),
    ChaosKind.DISK_KILL_MID_WRITE: (
        "a node actor is killed (-9) as it writes pages to disk, their records not yet "
        "appended; Ray restarts it and it adopts the pages whose writes were complete"
    ),
    ChaosKind.DISK_CORRUPT_PAGE: (
        "a byte of a page in a node's page file flips, its memory copies evicted: the next "
        "read of it must find it corrupt, drop it and miss"
    ),
    ChaosKind.DISK_FULL: (
        "a node's disk is full: its next writes' records find no room (ENOSPC); it keeps "
        "serving, those pages on disk for this run only"
    ),
}
# What each engine can suffer: the reference engine's requests go through the node
# actors' get and put; a vLLM engine's through staging, with its own processes.
_VLLM_PATH = (
    ChaosKind.WORKER_KILL_MID_LOAD,
    ChaosKind.WORKER_KILL_MID_SAVE,
    ChaosKind.NODE_KILL_MID_LOAD,
    ChaosKind.NODE_STALL,
    ChaosKind.SHM_FULL,
)
ENGINE_KINDS = {
    "reference": tuple(k for k in ChaosKind if k not in _VLLM_PATH),
    "vllm": (
        *_VLLM_PATH,
        ChaosKind.KILL_NODE_ACTOR,
        ChaosKind.KILL_SHARD,
        ChaosKind.ALLOC_FAIL,
        ChaosKind.EVICT_MID_REQUEST,
        ChaosKind.EVENT_DROP,
        ChaosKind.EVENT_DUPLICATE,
        ChaosKind.EVENT_REORDER,
        ChaosKind.DISK_KILL_MID_WRITE,
        ChaosKind.DISK_CORRUPT_PAGE,
        ChaosKind.DISK_FULL,
    ),
}
_RARE = {
    ChaosKind.REMOVE_READD_NODE: 25,
    ChaosKind.KILL_NODE_ACTOR: 6,
    ChaosKind.KILL_SHARD: 6,
    ChaosKind.KILL_DIRECTORY_MID_REBALANCE: 10,
    # An engine restarts in about a minute on CPU: a few at a time.
    ChaosKind.WORKER_KILL_MID_LOAD: 8,
    ChaosKind.WORKER_KILL_MID_SAVE: 8,
    ChaosKind.NODE_KILL_MID_LOAD: 6,
    ChaosKind.SHM_FULL: 8,
    ChaosKind.DISK_KILL_MID_WRITE: 6,
}


def schedule(seed: int, faults: int, kinds: Sequence[ChaosKind]) -> list[ChaosKind]:
    """A seeded fault list; heavy faults (restarts) come at most once per so many faults."""
    rng, out = random.Random(seed), []
    last: dict[ChaosKind, int] = {}
    for i in range(faults):
        allowed = [k for k in kinds if i - last.get(k, -(10**9)) >= _RARE.get(k, 1)]
        kind = rng.choice(allowed or [k for k in kinds if k not in _RARE] or list(kinds))
        last[kind] = i
        out.append(kind)
    return out
