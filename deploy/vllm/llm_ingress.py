"""FabricLLMIngress: Ray Serve LLM's OpenAI ingress with the fabric's tenants.

In a vLLM app a request's tenant is its `cache_salt`: vLLM salts its own prefix-cache
hashes with it, and the fabric keys its pages by it (namespaces.py). With a tenant table
(`tenants_file`, deploy/serve/tenants.py) the salt is no longer the client's to pick: every
completion or chat carries one of the table's API keys ("Authorization: Bearer <key>";
401 otherwise), its `cache_salt` must be a namespace the key grants (403 otherwise),
and one it leaves out becomes the key's default. Two keys that share no namespace never
share cached KV: not in vLLM's cache, the node pools or the index. Every other route
(models, embeddings, tokenize, the API description, ...) needs a key of the table too
(KeyGuard, in front of the whole app). Without a table it is Ray's ingress as it is.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from kvfabric.deploy.serve.ingress_auth import ASGIApp, Authorizer, KeyGuard
from kvfabric.deploy.serve.openai_errors import APIError
from kvfabric.deploy.serve.tenants import load_tenants
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    CompletionRequest,
)
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress


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
        return await serve(body, request)


def tenant_salt(auth: Authorizer, request: Request, asked: str | None) -> str:
    """The cache_salt a request runs with: its key's namespace (APIError 401 / 403)."""
    try:
        return auth.namespace(auth.tenant(request), asked)
    except APIError as e:
        if e.detail.param is not None:
            e.detail.param = "cache_salt"  # what a vLLM client names its namespace with
        raise
