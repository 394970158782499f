"""The chaos harness: a seeded fault schedule over a running fabric, its `kvfabric chaos`
run, and the pytest fixture for users' own suites."""

from kvfabric.deploy.serving.injectors import Injectors, register

from .faults import HOOKS, NodeChaos, StepFaultFile

# The apps take their injectors from here (production code imports nothing of chaos).
register(Injectors(node_hooks=NodeChaos, node_hooks_path=HOOKS, step_faults=StepFaultFile.settings))
