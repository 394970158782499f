"""The ingress's way to the model servers: a Ray Serve handle, with retries when a
replica dies under a request."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from kvfabric.deploy.serving.protocol import GenerateRequest, GenerateResult
from ray.exceptions import RayActorError

log = logging.getLogger(__name__)


class HandleBackend:
    """A Backend over a DeploymentHandle to the model-server deployment.

    A replica that dies under a request (its node went away) costs a retry on
    another replica, not the request: generation is deterministic, so a second
    run answers the same. Errors from a live replica are not retried."""

    def __init__(self, handle: Any, retries: int = 3, backoff_s: float = 0.25) -> None:
        self._handle, self._retries, self._backoff_s = handle, retries, backoff_s

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        for attempt in range(self._retries):
            try:
                return self._counted(await self._handle.generate.remote(req), attempt)
            except RayActorError:
                log.warning("a model-server replica died under a request; retrying elsewhere")
                await asyncio.sleep(self._backoff_s * (attempt + 1))  # Serve notices the death
        return self._counted(await self._handle.generate.remote(req), self._retries)

    @staticmethod
    def _counted(result: GenerateResult, retries: int) -> GenerateResult:
        return dataclasses.replace(result, retries=retries) if retries else result
