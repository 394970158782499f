"""The OpenAI-compatible HTTP ingress: /v1/completions, /v1/chat/completions (both also
streamed) and /v1/models over the fabric, the API the vLLM app speaks.

Untrusted input enters here, so every check happens before a GenerateRequest
exists: a request failing one gets a 4xx with an OpenAI-style error body and never
reaches a model server. A failure behind the ingress (a dead replica, a backend
bug) becomes a 503 with the same body shape, never a 500 traceback.
Who may call and which namespace a request uses is deploy/serving/ingress_auth.py's
(API keys from a tenant table, deploy/serving/tenants.py); request and response bodies are
deploy/reference/serve/openai_bodies.py's, error bodies deploy/serving/openai_errors.py's.
`build_fastapi` builds the app over any `Backend`; `OpenAIIngress` is the Ray
Serve deployment that builds it per replica over a handle to the model servers.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvfabric.deploy.reference.engine import RequestError
from kvfabric.deploy.reference.model import ModelConfig
from kvfabric.deploy.reference.tokenizer import ByteTokenizer
from kvfabric.deploy.serving.cache_namespace import cache_namespace
from kvfabric.deploy.serving.ingress_auth import Authorizer
from kvfabric.deploy.serving.openai_errors import APIError, ErrorResponse
from kvfabric.deploy.serving.openai_errors import bad_request as _bad
from kvfabric.deploy.serving.protocol import GenerateRequest, GenerateResult
from kvfabric.deploy.serving.tenants import TenantTable, load_tenants
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfabric._version import __version__

from .backend import HandleBackend
from .openai_bodies import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    KVFabricOptions,
    ModelCard,
    ModelList,
    SamplingRequest,
    check_supported,
    completion_response,
    parse_body,
    read_json,
    stream_chunks,
)

__all__ = [
    "APIError",
    "Backend",
    "CompletionRequest",
    "CompletionResponse",
    "HandleBackend",
    "KVFabricOptions",
    "OpenAIIngress",
    "build_fastapi",
]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # far above any prompt the model can take; caps parse work


class Backend(Protocol):
    """What the ingress needs of the model servers."""

    async def generate(self, req: GenerateRequest) -> GenerateResult: ...


# --- the app ----------------------------------------------------------------------------
def build_fastapi(
    backend: Backend,
    model_name: str,
    model_config: ModelConfig,
    tenants: TenantTable | None,
    max_tokens_limit: int = 256,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The OpenAI-compatible app over `backend`, serving one model named `model_name`, to
    the API keys of `tenants` (None: to anyone, as one tenant)."""
    if not callable(getattr(backend, "generate", None)):
        raise TypeError(f"backend {type(backend).__name__} has no generate method")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
    if not isinstance(model_config, ModelConfig):
        raise TypeError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
    if (
        not isinstance(max_tokens_limit, int)
        or isinstance(max_tokens_limit, bool)
        or not 0 < max_tokens_limit < model_config.max_positions
    ):
        raise ValueError(
            f"max_tokens_limit must be an int in [1, {model_config.max_positions}) "
            f"(a prompt needs at least one position), got {max_tokens_limit!r}"
        )
    if not isinstance(max_body_bytes, int) or max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be a positive int, got {max_body_bytes!r}")
    auth = Authorizer(tenants)
    tokenizer = ByteTokenizer(model_config.vocab)
    card = ModelCard(id=model_name, created=int(time.time()))
    app = FastAPI(
        title="ray-kv-fabric",
        description="OpenAI-compatible completions over a cluster-wide KV-cache fabric",
        version=__version__,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )  # auth.add_docs serves them
    auth.add_docs(app)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and methods get the OpenAI body shape too.
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        response = APIError(
            exc.status_code,
            f"{message}: {request.method} {request.url.path}",
            code="not_found" if exc.status_code == 404 else None,
        ).response()
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return response

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}  # no auth: load balancers and Serve probe it

    @app.get("/v1/models", response_model=ModelList)
    async def list_models(request: Request) -> ModelList:
        auth.tenant(request)
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def get_model(model_id: str, request: Request) -> ModelCard:
        auth.tenant(request)
        if model_id != model_name:
            raise APIError(
                404, f"the model {model_id!r} does not exist", code="model_not_found", param="model"
            )
        return card

    def prompt_ids(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                ids = tokenizer.encode(prompt)
            except ValueError as e:
                _bad(f"prompt: {e}", param="prompt")
        else:
            bad = next((i for i, t in enumerate(prompt) if not 0 <= t < model_config.vocab), None)
            if bad is not None:
                _bad(
                    f"prompt[{bad}] is {prompt[bad]}, not a token id in [0, {model_config.vocab})",
                    code="invalid_token",
                    param="prompt",
                )
            ids = list(prompt)
        if not ids:
            _bad("prompt is empty", param="prompt")
        return ids

    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 503)
    }

    async def answer(
        request: Request, kind: type[SamplingRequest], prompt: Callable[[Any], list[int]]
    ) -> Response:
        """One path for both routes: who asks, the body, its checks, the model server's
        answer (whole, or as a stream of its pieces)."""
        arrival = time.time()
        tenant = auth.tenant(request)  # before parsing: a stranger learns nothing
        req = parse_body(await read_json(request, max_body_bytes), kind)
        if req.model != model_name:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                code="model_not_found",
                param="model",
            )
        check_supported(req)
        asked = req.token_limit()
        if asked is not None and asked > max_tokens_limit:
            _bad(f"max_tokens is {asked}, the limit is {max_tokens_limit}", param="max_tokens")
        ids = prompt(req)
        room = model_config.max_positions - len(ids)
        max_tokens = asked if asked is not None else req.default_max_tokens
        if max_tokens is None:  # a chat without a limit: as many as fit, at least one
            max_tokens = max(1, min(max_tokens_limit, room))
        if len(ids) + max_tokens > model_config.max_positions:
            _bad(
                f"the prompt has {len(ids)} tokens; with max_tokens={max_tokens} the model's "
                f"{model_config.max_positions} positions leave room for "
                f"{model_config.max_positions - max_tokens}",
                code="context_length_exceeded",
                param="messages" if kind is ChatCompletionRequest else "prompt",
            )
        opts = req.kvfabric or KVFabricOptions()
        gen = GenerateRequest(
            tokens=tuple(ids),
            max_tokens=max_tokens,
            namespace=_namespace(auth, tenant, req.cache_salt, opts.namespace),
            use_cache=opts.cache,
            arrival_s=arrival,
            logits_digest=opts.logits_digest,
        )
        try:
            result = await backend.generate(gen)
            body = completion_response(
                result, model_name, tokenizer, chat=kind is ChatCompletionRequest
            )
        except Exception as e:  # never a 500: the client gets a retryable 503
            cause = getattr(e, "cause", e)  # a Ray task error wraps the replica's own
            if isinstance(cause, RequestError):  # the server refused it: the caller's fault
                _bad(f"the model server refused the request: {cause}", param="prompt")
            log.exception("completion backend failed")
            raise APIError(
                503,
                f"the model backend failed ({type(cause).__name__}); retry later",
                type="server_error",
                code="backend_unavailable",
            ) from None
        if not req.stream:
            return JSONResponse(body.model_dump())
        # The reference engine answers a request whole: its stream comes at once, a
        # chunk per token, in the shape OpenAI's clients read.
        usage = req.stream_options is not None and req.stream_options.include_usage
        pieces = tokenizer.decode_pieces(result.tokens)
        events = [f"data: {json.dumps(c)}\n\n" for c in stream_chunks(body, pieces, usage)]
        return StreamingResponse(
            iter([*events, "data: [DONE]\n\n"]), media_type="text/event-stream"
        )

    @app.post("/v1/completions", response_model=CompletionResponse, responses=errors)
    async def completions(request: Request) -> Response:
        return await answer(request, CompletionRequest, lambda req: prompt_ids(req.prompt))

    def chat_ids(req: ChatCompletionRequest) -> list[int]:
        try:
            return tokenizer.encode_chat(req.turns())
        except ValueError as e:
            _bad(f"messages: {e}", param="messages")

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=errors)
    async def chat_completions(request: Request) -> Response:
        return await answer(request, ChatCompletionRequest, chat_ids)

    return app


def _namespace(auth: Authorizer, tenant: Any, salt: str | None, named: str | None) -> str:
    """The cache namespace of the namespace a request asked for, by `cache_salt` (as
    vLLM's clients name it) or `kvfabric.namespace`, as its key grants it (403 naming the
    field it came in): the one a vLLM app's request with that salt gets."""
    if salt is not None and named is not None and salt != named:
        _bad("cache_salt and kvfabric.namespace name different namespaces: give one")
    if salt is None:
        return cache_namespace(auth.namespace(tenant, named))
    return cache_namespace(auth.namespace(tenant, salt, field="cache_salt"))


# --- Ray Serve --------------------------------------------------------------------------
@serve.deployment
@serve.ingress()
class OpenAIIngress:
    """The HTTP ingress deployment. The app depends on per-deployment config, so it
    is built on each replica after the constructor (Serve's late-bound ingress:
    `__serve_build_asgi_app__`), not at import time."""

    def __init__(
        self,
        server: Any,
        model_name: str,
        model_config: ModelConfig = ModelConfig(),
        tenants_file: str | None = None,
        max_tokens_limit: int = 256,
    ) -> None:
        # Built here so that bad config fails the replica's start, loudly. The table is read
        # here, from the file on this node, so that no key digest travels in Serve's config.
        tenants = load_tenants(tenants_file) if tenants_file is not None else None
        self._app = build_fastapi(
            HandleBackend(server), model_name, model_config, tenants, max_tokens_limit
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app
