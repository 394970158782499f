"""The OpenAI-compatible HTTP ingress: /v1/completions and /v1/models over the fabric.

Untrusted input enters here, so every check happens before a GenerateRequest
exists: a request failing one gets a 4xx with an OpenAI-style error body and never
reaches a model server. A failure behind the ingress (a dead replica, a backend
bug) becomes a 503 with the same body shape, never a 500 traceback.
Who may call and which cache namespace a request uses is deploy/serve/ingress_auth.py's
(API keys from a tenant table, deploy/serve/tenants.py); error bodies are deploy/serve/openai_errors.py's.
`build_fastapi` builds the app over any `Backend`; `OpenAIIngress` is the Ray
Serve deployment that builds it per replica over a handle to the model servers.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, NoReturn, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from .backend import HandleBackend
from kvfabric.deploy.reference.engine import RequestError
from .ingress_auth import Authorizer
from kvfabric.deploy.reference.model import ModelConfig
from .openai_errors import APIError, ErrorResponse
from .openai_errors import bad_request as _bad
from .protocol import GenerateRequest, GenerateResult, PrefixFetch
from .tenants import MAX_NAME_CHARS, TenantTable, load_tenants
from kvfabric.deploy.reference.tokenizer import ByteTokenizer

__all__ = ["APIError", "Backend", "CompletionRequest", "CompletionResponse", "HandleBackend",
           "KVFabricOptions", "OpenAIIngress", "build_fastapi"]

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 1 << 20         # far above any prompt the model can take; caps parse work


class Backend(Protocol):
    """What the ingress needs of the model servers."""
    async def generate(self, req: GenerateRequest) -> GenerateResult: ...


# --- request and response bodies --------------------------------------------------------
class KVFabricOptions(BaseModel):
    """The `kvfabric` extension object of a completion request."""
    model_config = ConfigDict(extra="forbid", strict=True)
    namespace: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    cache: bool = True           # the namespace must be one the caller's API key grants
    # Answer a hash of every step's logits, to check outputs bit for bit (the demo and
    # the chaos harness ask): it keeps and copies every step's logits, so only on request.
    logits_digest: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions. Strict: JSON `true` is no int and `"16"` no number."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    prompt: str | list[int]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=0)
    temperature: float | None = None
    stream: bool = False
    user: str | None = Field(default=None, max_length=MAX_NAME_CHARS)   # OpenAI's end-user id: not a namespace
    kvfabric: KVFabricOptions | None = None
    # OpenAI sampling parameters: accepted at the value that keeps decoding greedy
    # and single-choice (clients often send the defaults), refused otherwise rather
    # than silently ignored. Greedy decoding is deterministic, so any seed is fine.
    n: int | None = None
    best_of: int | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    echo: bool | None = None
    logprobs: int | None = None
    stop: str | list[str] | None = None
    suffix: str | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    stream_options: dict[str, Any] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        # One clear message instead of pydantic's per-union-member errors.
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise PydanticCustomError("prompt_type", "expected a string or a list of token ids")
        if any(isinstance(t, (str, list)) for t in v):
            raise PydanticCustomError("prompt_batch", "batched prompts are not supported: send one "
                                      "prompt (a string or a list of token ids) per request")
        bad = [t for t in v if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            raise PydanticCustomError("prompt_ids", "token ids must be integers, got {bad}",
                                      {"bad": _json_repr(bad[0])})
        return v


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: None = None


class KVFabricInfo(BaseModel):
    """Where the prompt's K/V came from, per request (the `kvfabric` extension)."""
    cached_tokens: int
    device_tokens: int
    host_tokens: int
    remote_tokens: int
    fetch: PrefixFetch
    ttft_ms: float
    node: str
    logits_digest: str              # "" unless the request asked for it
    token_ids: list[int]
    retries: int = 0                # replicas that died under it; the ingress retried elsewhere
    fetched_bytes: int = 0          # KV bytes its remote fetch moved, as the model server counts them


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kvfabric: KVFabricInfo


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "ray-kv-fabric"


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


# --- parsing ----------------------------------------------------------------------------
def _json_repr(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")      # json.loads accepts NaN/Infinity otherwise


async def _read_json(request: Request, limit: int) -> Any:
    too_large = APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():       # a missing or lying Content-Length too
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # bad syntax, bad encoding, huge ints, deep nesting
        _bad(f"request body is not valid JSON: {e}", code="invalid_json")


def _parse(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        _bad(f"request body must be a JSON object, got {_json_repr(body)}", code="invalid_body")
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        parts = [f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in errors[:3]]
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
        _bad("invalid request: " + "; ".join(parts) + more, code="invalid_body", param=param)


def _check_supported(req: CompletionRequest) -> None:
    if req.stream:
        _bad("streaming is not supported: send stream=false", code="unsupported_parameter",
             param="stream")
    if req.temperature not in (None, 0):
        _bad(f"only greedy decoding is supported: temperature must be 0 or null, "
             f"got {req.temperature}", code="unsupported_parameter", param="temperature")
    neutral = {"n": req.n in (None, 1), "best_of": req.best_of in (None, 1),
               "top_p": req.top_p in (None, 1), "presence_penalty": req.presence_penalty in (None, 0),
               "frequency_penalty": req.frequency_penalty in (None, 0), "echo": not req.echo,
               "logprobs": req.logprobs is None, "stop": not req.stop, "suffix": not req.suffix,
               "logit_bias": not req.logit_bias, "stream_options": req.stream_options is None}
    for name, ok in neutral.items():
        if not ok:
            _bad(f"{name}={_json_repr(getattr(req, name))} is not supported: this server "
                 f"decodes greedily, one choice per request, without logprobs or stop sequences",
                 code="unsupported_parameter", param=name)


# --- the app ----------------------------------------------------------------------------
def build_fastapi(backend: Backend, model_name: str, model_config: ModelConfig,
                  tenants: TenantTable | None, max_tokens_limit: int = 256, *,
                  max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The OpenAI-compatible app over `backend`, serving one model named `model_name`, to
    the API keys of `tenants` (None: to anyone, as one tenant)."""
    if not callable(getattr(backend, "generate", None)):
        raise TypeError(f"backend {type(backend).__name__} has no generate method")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
    if not isinstance(model_config, ModelConfig):
        raise TypeError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
    if (not isinstance(max_tokens_limit, int) or isinstance(max_tokens_limit, bool)
            or not 0 < max_tokens_limit < model_config.max_positions):
        raise ValueError(f"max_tokens_limit must be an int in [1, {model_config.max_positions}) "
                         f"(a prompt needs at least one position), got {max_tokens_limit!r}")
    if not isinstance(max_body_bytes, int) or max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes must be a positive int, got {max_body_bytes!r}")
    auth = Authorizer(tenants)
    tokenizer = ByteTokenizer(model_config.vocab)
    card = ModelCard(id=model_name, created=int(time.time()))
    app = FastAPI(title="ray-kv-fabric", description="OpenAI-compatible completions over a "
                  "cluster-wide KV-cache fabric", version="0.1.0",
                  openapi_url=None, docs_url=None, redoc_url=None)    # auth.add_docs serves them
    auth.add_docs(app)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and methods get the OpenAI body shape too.
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        response = APIError(exc.status_code, f"{message}: {request.method} {request.url.path}",
                            code="not_found" if exc.status_code == 404 else None).response()
        response.headers.update(exc.headers or {})       # e.g. a 405's Allow
        return response

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}       # no auth: load balancers and Serve probe it

    @app.get("/v1/models", response_model=ModelList)
    async def list_models(request: Request) -> ModelList:
        auth.tenant(request)
        return ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def get_model(model_id: str, request: Request) -> ModelCard:
        auth.tenant(request)
        if model_id != model_name:
            raise APIError(404, f"the model {model_id!r} does not exist", code="model_not_found",
                           param="model")
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
                _bad(f"prompt[{bad}] is {prompt[bad]}, not a token id in [0, {model_config.vocab})",
                     code="invalid_token", param="prompt")
            ids = list(prompt)
        if not ids:
            _bad("prompt is empty", param="prompt")
        return ids

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
                         403: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
                         503: {"model": ErrorResponse}})
    async def completions(request: Request) -> JSONResponse:
        arrival = time.time()
        tenant = auth.tenant(request)           # before parsing: a stranger learns nothing
        req = _parse(await _read_json(request, max_body_bytes))
        if req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                           f"{model_name!r}", code="model_not_found", param="model")
        _check_supported(req)
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        if max_tokens > max_tokens_limit:
            _bad(f"max_tokens is {max_tokens}, the limit is {max_tokens_limit}", param="max_tokens")
        ids = prompt_ids(req.prompt)
        room = model_config.max_positions - max_tokens
        if len(ids) > room:
            _bad(f"the prompt has {len(ids)} tokens; with max_tokens={max_tokens} the model's "
                 f"{model_config.max_positions} positions leave room for {room}",
                 code="context_length_exceeded", param="prompt")
        opts = req.kvfabric or KVFabricOptions()
        gen = GenerateRequest(tokens=tuple(ids), max_tokens=max_tokens,
                              namespace=auth.namespace(tenant, opts.namespace),
                              use_cache=opts.cache, arrival_s=arrival,
                              logits_digest=opts.logits_digest)
        try:
            result = await backend.generate(gen)
            body = _completion(result, model_name, tokenizer)
        except Exception as e:        # never a 500: the client gets a retryable 503
            cause = getattr(e, "cause", e)         # a Ray task error wraps the replica's own
            if isinstance(cause, RequestError):    # the server refused it: the caller's fault
                _bad(f"the model server refused the request: {cause}", param="prompt")
            log.exception("completion backend failed")
            raise APIError(503, f"the model backend failed ({type(cause).__name__}); retry later",
                           type="server_error", code="backend_unavailable") from None
        return JSONResponse(body.model_dump())

    return app


def _completion(result: GenerateResult, model_name: str, tokenizer: ByteTokenizer) -> CompletionResponse:
    if not isinstance(result, GenerateResult):
        raise TypeError(f"backend returned {type(result).__name__}, not a GenerateResult")
    ids = [int(t) for t in result.tokens]
    return CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name,
        # No end-of-text token: every completion runs to max_tokens.
        choices=[CompletionChoice(index=0, text=tokenizer.decode(ids), finish_reason="length")],
        usage=Usage(prompt_tokens=result.prompt_tokens, completion_tokens=len(ids),
                    total_tokens=result.prompt_tokens + len(ids)),
        kvfabric=KVFabricInfo(
            cached_tokens=result.cached_tokens, device_tokens=result.device_tokens,
            host_tokens=result.host_tokens, remote_tokens=result.remote_tokens, fetch=result.fetch,
            ttft_ms=result.ttft_s * 1e3, node=result.node, logits_digest=result.logits_digest,
            token_ids=ids, retries=result.retries, fetched_bytes=result.fetched_bytes))


# --- Ray Serve --------------------------------------------------------------------------
@serve.deployment
@serve.ingress()
class OpenAIIngress:
    """The HTTP ingress deployment. The app depends on per-deployment config, so it
    is built on each replica after the constructor (Serve's late-bound ingress:
    `__serve_build_asgi_app__`), not at import time."""

    def __init__(self, server: Any, model_name: str, model_config: ModelConfig = ModelConfig(),
                 tenants_file: str | None = None, max_tokens_limit: int = 256) -> None:
        # Built here so that bad config fails the replica's start, loudly. The table is read
        # here, from the file on this node, so that no key digest travels in Serve's config.
        tenants = load_tenants(tenants_file) if tenants_file is not None else None
        self._app = build_fastapi(HandleBackend(server), model_name, model_config, tenants,
                                  max_tokens_limit)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app
