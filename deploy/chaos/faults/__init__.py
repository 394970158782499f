"""The fault injectors, for tests and chaos runs: production code only offers the hooks
they plug into (a cache's reservation hook, the Transport interface, a node's NodeHooks,
the vLLM connector's step hook). No Ray here."""

from .action import ChaosAction
from .allocation import AllocationFaults
from .disk import DiskFault, DiskFaults
from .events import EventFault, EventMangler
from .faulty_transport import FaultyTransport
from .node import HOOKS, NodeChaos
from .step_file import InjectedFault, StepFaultFile
from .transfer import Fault, FaultKind, FaultPlan

__all__ = [
    "AllocationFaults",
    "ChaosAction",
    "DiskFault",
    "DiskFaults",
    "EventFault",
    "EventMangler",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "FaultyTransport",
    "HOOKS",
    "InjectedFault",
    "NodeChaos",
    "StepFaultFile",
]
