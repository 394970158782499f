"""StepFaultFile: a StepHook (deploy/vllm/jobs.py) that fails the vLLM connector's
loads and saves where a JSON file says, read at each step: the connector runs in
vLLM's engine and worker processes, which a test reaches only through a file.

The file maps a step ("node_load", "worker_load", "worker_save", "node_save") to an
exception class name, or to "SIGKILL": the process running that step is killed there
(-9: vLLM's engine core, where the scheduler side and a TP=1 worker run, or a TP worker),
as a crash or the OOM killer would. A fault that fired is taken out of the file first, so
the test sees that it did."""

from __future__ import annotations

import json
import os
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # deploy/vllm imports vLLM: only its type is needed here
    from kvfabric.deploy.vllm.jobs import ConnectorStep

HOOK = "kvfabric.deploy.chaos.faults.step_file:StepFaultFile"
KILL = "SIGKILL"


class InjectedFault(Exception):
    """Raised where a test armed a fault of no built-in kind."""


_EXCEPTIONS = {
    "ValueError": ValueError,
    "KeyError": KeyError,
    "RuntimeError": RuntimeError,
    "MemoryError": MemoryError,
    "OSError": OSError,
    "TimeoutError": TimeoutError,
    "IndexError": IndexError,
    "InjectedFault": InjectedFault,
}


class StepFaultFile:
    def __init__(self, path: str) -> None:
        if not path:
            raise ValueError("StepFaultFile needs the fault file's path (step_hook_arg)")
        self.path = path

    @staticmethod
    def settings(path: str) -> dict[str, Any]:
        """The FabricConnector settings that install this hook on `path`."""
        return {"step_hook": HOOK, "step_hook_arg": path}

    def __call__(self, step: ConnectorStep) -> None:
        """Raise, once, the exception armed at `step` in the file, if any."""
        if not os.path.exists(self.path):
            return
        try:
            with open(self.path) as f:
                armed = json.load(f)
        except (OSError, ValueError):
            return  # being rewritten by the test: read it at the next step
        name = armed.pop(step.value, None)
        if not name:
            return
        tmp = f"{self.path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(armed, f)
        os.replace(tmp, self.path)
        if name == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        raise _EXCEPTIONS.get(name, InjectedFault)(f"injected at {step.value}")
