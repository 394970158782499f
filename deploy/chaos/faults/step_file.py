"""StepFaultFile: a StepHook (deploy/vllm/connector/jobs.py) that fails the vLLM connector's
loads and saves where a JSON file says, read at each step: the connector runs in
vLLM's engine and worker processes, which a test reaches only through a file.

The file maps a step ("node_load", "worker_load", "worker_save", "node_save", "staging")
to an exception class name; to "SIGKILL": the process running that step is killed there
(-9: vLLM's engine core, where the scheduler side and a TP=1 worker run, or a TP worker),
as a crash or the OOM killer would; or to "ENOSPC": the step fails as a full /dev/shm
fails it (StagingSpaceError). A fault that fired is taken out of the file first, so the
test sees that it did."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
from typing import TYPE_CHECKING, Any, Iterator

from kvfabric.transport.staging import SHM_DIR, StagingSpaceError

if TYPE_CHECKING:  # deploy/vllm imports vLLM: only its type is needed here
    from kvfabric.deploy.vllm.connector.jobs import ConnectorStep

HOOK = "kvfabric.deploy.chaos.faults.step_file:StepFaultFile"
KILL = "SIGKILL"
FULL = "ENOSPC"


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
        name = self._take(step.value)
        if not name:
            return
        if name == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        if name == FULL:
            raise StagingSpaceError(errno.ENOSPC, f"injected at {step.value}: {SHM_DIR} is full")
        raise _EXCEPTIONS.get(name, InjectedFault)(f"injected at {step.value}")

    # The harness arms and disarms while engines take: each whole read-change-write holds
    # the lock, so a fault is either taken (and fires) or disarmed, never both or neither.
    def arm(self, armed: dict[str, str]) -> None:
        with self._locked():
            self._write(armed)

    def disarm(self) -> dict[str, str]:
        """Take every fault out; returns those that had not fired."""
        with self._locked():
            left = self._read()
            self._write({})
        return left

    def armed(self) -> dict[str, str]:
        with self._locked():
            return self._read()

    def _take(self, step: str) -> str | None:
        with self._locked():
            armed = self._read()
            name = armed.pop(step, None)
            if name:
                self._write(armed)
        return name

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _read(self) -> dict[str, str]:
        try:
            with open(self.path) as f:
                armed = json.load(f)
        except (OSError, ValueError):
            return {}  # none yet, or written by a test without the lock: next step
        return armed if isinstance(armed, dict) else {}

    def _write(self, armed: dict[str, str]) -> None:
        tmp = f"{self.path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(armed, f)
        os.replace(tmp, self.path)
