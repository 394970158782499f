"""Placement: the cost model and the routers, one module for every user of them.

The Serve router (kvfabric.deploy.serving.router) ranks replicas with `FabricScore`, the
engine (kvfabric.deploy.reference.engine) fetches by `plan`, and `kvfabric replay` runs
the same objects, next to the routers users run today (`PowerOfTwo`, `PrefixAffinity`), so
that what it measures is what is deployed."""

from .affinity import PrefixAffinity
from .cost import CostModel, PageBytes, Plan, Prompt, plan
from .routers import FabricScore, NodeView, PowerOfTwo, Request, Router, least_queued

__all__ = [
    "CostModel",
    "FabricScore",
    "NodeView",
    "PageBytes",
    "Plan",
    "PowerOfTwo",
    "PrefixAffinity",
    "Prompt",
    "Request",
    "Router",
    "least_queued",
    "plan",
]
