"""A node actor's reports of its committed on-demand fetches to the fabric's directory,
which replicates the prefixes many nodes fetch (actors/replicas.py). Fire and forget: a
lost report only makes a prefix look less hot."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import ray
from kvfabric.actors.names import DIRECTORY
from kvfabric.actors.replicas import FetchReport

log = logging.getLogger(__name__)


class FetchReports:
    def __init__(self, node: str, fabric: str, page_tokens: int) -> None:
        self.node, self.fabric, self.page_tokens = node, fabric, page_tokens
        self._directory: Any = None
        self.sent = 0

    def __call__(
        self, peer: str, tokens: Sequence[int], namespace: str, keys: tuple[bytes, ...]
    ) -> None:
        if self._directory is None:
            try:
                self._directory = ray.get_actor(DIRECTORY, namespace=self.fabric)
            except ValueError:
                log.debug("no directory in %s: fetch not reported", self.fabric)
                return  # a node actor started alone (tests, tools)
        report = FetchReport(
            peer, self.node, namespace, tuple(tokens[: len(keys) * self.page_tokens]), keys
        )
        self._directory.fetched.remote(report)
        self.sent += 1
