"""An engine process on a node actor's host, as its connector announces itself.

The node maps an engine's staging pages, and the index keeps what the engine's own
device cache holds under the engine's name. An engine that stops cleanly says so; one
that crashes does not, so its node watches the process itself (same host, same PID
namespace): a process gone, or its PID reused by another (the start time differs),
means the engine is gone, and the node drops what it kept for it.

A node actor restarts (Ray restarts it, with nothing of its former life): so an engine
also leaves its announcement beside its staging files (`<prefix>.engine` in /dev/shm,
`write_record`), and a node actor that starts adopts the records of its own engines
(`read_records`): one that is still running is watched again, one that ended while the
node was down is reaped at the next heartbeat, its staging and index entries with it.
The staging files of other nodes' engines that ended are unlinked too
(`free_dead_staging`): their node may never start again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kvfabric.core.cache.layout import PoolName
from kvfabric.transport import staging
from kvfabric.transport.staging import StagingError, StagingSpec, check_spec

log = logging.getLogger(__name__)

MAX_NAME = 256
PROC = Path("/proc")
_HEX = re.compile(r"(?:[0-9a-f]{2}){0,32}")
RECORD = ".engine"  # an engine's record: its staging prefix and this suffix
MAX_RECORDS = 1024  # records a starting node reads (more: the rest are ignored)


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


RECORD_FIELDS = {
    "pid",
    "started",
    "staging",
    "index_name",
    "index_epoch",
    "node",
    "fabric",
}


@dataclass(frozen=True)
class EngineProcess:
    pid: int
    started: int  # process_start(pid) when it announced itself
    staging: StagingSpec
    index_name: str = ""  # its device cache's publisher in the index; "": not fed
    index_epoch: int = 0  # the epoch that publisher claimed (this life of the name)
    node: str = ""  # the node actor it announced itself to (its record says so)
    fabric: str = ""  # the fingerprint (hex) of the layout that node caches

    @classmethod
    def this_process(
        cls,
        staging: StagingSpec,
        index_name: str = "",
        index_epoch: int = 0,
        node: str = "",
        fabric: str = "",
    ) -> "EngineProcess":
        pid = os.getpid()
        return cls(pid, process_start(pid) or 0, staging, index_name, index_epoch, node, fabric)

    def record_path(self) -> Path:
        return staging.SHM_DIR / f"{check_spec(self.staging).prefix}{RECORD}"

    def write_record(self) -> Path:
        """Leave this announcement where a restarted node actor finds it (atomically: a
        reader sees the whole record or none)."""
        path = self.record_path()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kvf-record-")
        with os.fdopen(fd, "w") as f:
            json.dump({**asdict(self), "staging": asdict(self.staging)}, f)
        os.replace(tmp, path)
        return path

    @classmethod
    def read_records(cls, node: str, fabric: str) -> list["EngineProcess"]:
        """The records of `node`'s engines in `fabric`; one that does not parse or check is
        skipped (logged), never trusted."""
        return [p for p in cls.records() if p.node == node and p.fabric == fabric]

    @classmethod
    def free_dead_staging(cls, node: str, fabric: str) -> list[str]:
        """Unlink the staging files of other nodes' and fabrics' engines on this host that
        ended: a record whose node never starts again (its Ray node was replaced, or its
        fabric stopped) would keep them for good, gigabytes an engine on a real model. The
        record stays for its own node, which retires the engine's index life if it comes
        back. Returns the prefixes freed."""
        freed = []
        for proc in cls.records():
            if (proc.node, proc.fabric) == (node, fabric) or proc.alive():
                continue
            paths = [proc.staging.path(pool) for pool in PoolName]
            if any(p.exists() for p in paths):
                for path in paths:
                    path.unlink(missing_ok=True)
                freed.append(proc.staging.prefix)
        return freed

    @classmethod
    def records(cls) -> list["EngineProcess"]:
        """Every engine record on this host that parses and checks (each against the node
        it names)."""
        found = []
        paths = sorted(staging.SHM_DIR.glob(f"*{RECORD}"))
        for path in paths[:MAX_RECORDS]:
            try:
                if path.stat().st_size > 4096:
                    raise ValueError("larger than a record")
                d = json.loads(path.read_text())
                if not isinstance(d, dict) or set(d) != RECORD_FIELDS:
                    raise ValueError(f"fields {sorted(d) if isinstance(d, dict) else d!r:.80}")
                s = d["staging"]
                if not isinstance(s, dict) or set(s) != {"prefix", "pages"}:
                    raise ValueError(f"staging {s!r:.80}")
                proc = cls(**{**d, "staging": StagingSpec(s["prefix"], s["pages"])})
                proc.check(proc.node)
                if path != proc.record_path():
                    raise ValueError("its name is not its staging prefix's")
            except (OSError, ValueError, TypeError, EngineProcessError) as e:
                log.warning("ignoring engine record %s: %s", path, e)
                continue
            found.append(proc)
        return found

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
        if not isinstance(self.node, str) or self.node not in ("", node):
            raise EngineProcessError(f"announced to {self.node!r:.80}, not to {node}")
        if not isinstance(self.fabric, str) or not _HEX.fullmatch(self.fabric):
            raise EngineProcessError(
                f"fabric must be a layout fingerprint, got {self.fabric!r:.80}"
            )
