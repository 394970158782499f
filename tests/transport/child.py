"""A transport test's peer in a child process, spoken to over a pipe: spawned (its NIXL
agent and UCX start fresh, not forked from ours), and stopped politely, then killed."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable


def spawn(target: Callable[..., object], *args: Any) -> tuple[BaseProcess, Connection]:
    """Start `target(pipe end, *args)` in a spawned daemon process; the process and our end."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()  # a child dying during start-up then reads as EOF at once
    return proc, conn


def stop(proc: BaseProcess, conn: Connection, quit_message: object, grace_s: float) -> None:
    """Ask the child to quit, give it `grace_s` to end, then kill it."""
    if proc.is_alive():
        try:
            conn.send(quit_message)
        except (BrokenPipeError, OSError):
            pass  # the child is already gone: join below just reaps it
        proc.join(grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
