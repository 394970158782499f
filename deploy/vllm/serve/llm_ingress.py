"""FabricLLMIngress: Ray Serve LLM's OpenAI ingress with the fabric's tenants.

In a vLLM app a request's namespace is its `cache_salt`: vLLM salts its own prefix-cache
hashes with it, and the fabric files its pages under it (serving/cache_namespace.py). With a
tenant table
(`tenants_file`, deploy/serving/tenants.py) the salt is no longer the client's to pick: every
completion or chat carries one of the table's API keys ("Authorization: Bearer <key>";
401 otherwise), its `cache_salt` must be a namespace the key grants (403 otherwise),
and one it leaves out becomes the key's default. Two keys that share no namespace never
share cached KV: not in vLLM's cache, the node pools or the index. Every other route
(models, embeddings, tokenize, the API description, ...) needs a key of the table too
(KeyGuard, in front of the whole app). Without a table it is Ray's ingress as it is.

A completion or chat whose engine died under it (vLLM's EngineDeadError: a worker
crashed or was killed; or the replica's actor gone) runs again, on whichever replica
Serve then routes it to: nothing of it reached the client, so the client sees only the
delay (and the `x-kvfabric-retries` header). Serve stops routing to a replica whose
engine died once its health checks fail (about half a minute), so the retries wait
longer each time. A stream is not retried (its first chunk may be out).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from kvfabric.deploy.serving.ingress_auth import ASGIApp, Authorizer, KeyGuard
from kvfabric.deploy.serving.openai_errors import APIError
from kvfabric.deploy.serving.tenants import load_tenants
from ray.exceptions import RayActorError
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    CompletionRequest,
)
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

log = logging.getLogger(__name__)

RETRIES = 6  # waits of 1, 2, 4, 8, 16 and 32 s: past Serve's health checks of a dead engine
BACKOFF_S = 1.0
RETRIES_HEADER = "x-kvfabric-retries"


class FabricLLMIngress(OpenAiIngress):
    def __init__(
        self, llm_deployments: dict, model_cards: dict, *, tenants_file: str = "", **kwargs: Any
    ) -> None:
        super().__init__(llm_deployments, model_cards, **kwargs)
        self._auth = Authorizer(load_tenants(tenants_file)) if tenants_file else None

    def _set_asgi_app(self, app: ASGIApp) -> None:
        # Serve's replica wrapper (ASGIAppReplicaWrapper, after this class in the
        # ingress's MRO) sets the app it serves here, once this constructor has run: the
        # one place the whole route table, FastAPI's own /docs included, can be guarded.
        guarded = KeyGuard(app, self._auth) if self._auth is not None else app
        super()._set_asgi_app(guarded)  # type: ignore[misc]

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._as_tenant(body, request, super().completions)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._as_tenant(body, request, super().chat)

    async def _as_tenant(
        self, body: Any, request: Request, serve: Callable[[Any, Request], Awaitable[Response]]
    ) -> Response:
        if self._auth is not None:
            try:
                body.cache_salt = tenant_salt(self._auth, request, body.cache_salt)
            except APIError as e:
                return e.response()
        if getattr(body, "stream", False):
            return await serve(body, request)
        for attempt in range(RETRIES + 1):
            try:
                response = await serve(body, request)
            except Exception as e:
                if attempt == RETRIES or not engine_gone(e):
                    raise
                log.warning("an engine died under a request (%s); running it again", e)
                await asyncio.sleep(BACKOFF_S * 2**attempt)
                continue
            if attempt:
                response.headers[RETRIES_HEADER] = str(attempt)
            return response
        raise AssertionError("unreachable: the last attempt returns or raises")


def engine_gone(error: BaseException) -> bool:
    """Whether `error` (or what caused it) says the request's engine died: vLLM's
    EngineDeadError, as raised or as the error response Ray's ingress turns it into,
    or the replica's actor gone."""
    seen: BaseException | None = error
    for _ in range(8):  # a chain of causes, bounded
        if seen is None:
            return False
        if isinstance(seen, RayActorError) or "EngineDeadError" in (
            type(seen).__name__ + str(seen) + str(getattr(seen, "type", ""))
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def tenant_salt(auth: Authorizer, request: Request, asked: str | None) -> str | None:
    """The cache_salt a request runs with: a namespace its key's tenant grants (APIError
    401 / 403)."""
    return auth.namespace(auth.tenant(request), asked, field="cache_salt")
