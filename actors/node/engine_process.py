"""An engine process on a node actor's host, as its connector announces itself.

The node maps an engine's staging pages, and the index keeps what the engine's own
device cache holds under the engine's name. An engine that stops cleanly says so; one
that crashes does not, so its node watches the process itself (same host, same PID
namespace): a process gone, or its PID reused by another (the start time differs),
means the engine is gone, and the node drops what it kept for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfabric.transport.staging import StagingError, StagingSpec, check_spec

MAX_NAME = 256
PROC = Path("/proc")


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None when there is no such
    process, or no /proc to ask."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces and parentheses.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def can_watch() -> bool:
    """Whether this host shows processes in /proc (Linux): elsewhere no engine is reaped."""
    return (PROC / "self" / "stat").exists()


class EngineProcessError(ValueError):
    """An engine's announcement that is not a process of this host's engines."""


@dataclass(frozen=True)
class EngineProcess:
    pid: int
    started: int  # process_start(pid) when it announced itself
    staging: StagingSpec
    index_name: str = ""  # its device cache's publisher in the index; "": not fed
    index_epoch: int = 0  # the epoch that publisher claimed (this life of the name)

    @classmethod
    def this_process(
        cls, staging: StagingSpec, index_name: str = "", index_epoch: int = 0
    ) -> "EngineProcess":
        import os

        pid = os.getpid()
        return cls(pid, process_start(pid) or 0, staging, index_name, index_epoch)

    def alive(self) -> bool:
        if not can_watch():
            return True
        return process_start(self.pid) == self.started

    def check(self, node: str) -> None:
        """Refuse what is not an engine of node `node` (an index name under another node
        would let one engine drop another's entries)."""
        if (
            type(self.pid) is not int
            or self.pid <= 0
            or type(self.started) is not int
            or self.started < 0
        ):
            raise EngineProcessError(
                f"pid and start must be ints > 0 and >= 0, got {self.pid!r}, {self.started!r}"
            )
        try:
            check_spec(self.staging)
        except StagingError as e:
            raise EngineProcessError(f"staging: {e}") from None
        name = self.index_name
        if (
            not isinstance(name, str)
            or len(name) > MAX_NAME
            or (name and not name.startswith(node + "/"))
        ):
            raise EngineProcessError(f"index name must be empty or under {node}/, got {name!r:.80}")
        if type(self.index_epoch) is not int or not 0 <= self.index_epoch < 1 << 62:
            raise EngineProcessError(
                f"index epoch must be an int >= 0, got {self.index_epoch!r:.40}"
            )
