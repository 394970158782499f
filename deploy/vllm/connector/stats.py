"""The scheduler side's counters: what vLLM's stat loggers report (metrics.py) and the
node hears (`kvfabric status`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .remote_fetch import RemoteStats


@dataclass
class ConnectorStats:
    lookups: int = 0
    lookups_answered_by_match: int = 0  # the admission's match said nothing to load: no load call
    loaded_tokens: int = 0
    host_loaded_tokens: int = 0  # loaded back from the node's host tier
    remote_loaded_tokens: int = 0  # fetched from another node for the request
    load_failures: int = 0
    saved_requests: int = 0
    stored_pages: int = 0
    save_failures: int = 0
    node_errors: int = 0
    finished_requests: int = 0
    # Requests never cached: prompt embeddings, or a LoRA adapter whose files cannot be read.
    uncacheable_requests: int = 0
    # Staging slots out of use now: held for node calls given up on that have not ended.
    quarantined_slots: int = 0
    remote: RemoteStats = field(default_factory=RemoteStats)
