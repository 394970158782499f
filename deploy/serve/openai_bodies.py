"""The OpenAI ingress's request and response bodies: what a /v1/completions body may be,
read and checked before anything else sees it (a body too large, not JSON, of the wrong
shape or asking what this server does not do is refused with an OpenAI-style 4xx), and
the completion built from a model server's result."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, NoReturn

from fastapi import Request
from kvfabric.deploy.reference.tokenizer import ByteTokenizer
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from .openai_errors import APIError
from .openai_errors import bad_request as _bad
from .protocol import GenerateResult, PrefixFetch
from .tenants import MAX_NAME_CHARS

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# --- request and response bodies --------------------------------------------------------
class KVFabricOptions(BaseModel):
    """The `kvfabric` extension object of a completion request."""

    model_config = ConfigDict(extra="forbid", strict=True)
    namespace: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    cache: bool = True  # the namespace must be one the caller's API key grants
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
    user: str | None = Field(
        default=None, max_length=MAX_NAME_CHARS
    )  # OpenAI's end-user id: not a namespace
    kvfabric: KVFabricOptions | None = None
    # The tenant's namespace as vLLM's clients name it (the vLLM app's tenant field): the
    # same as kvfabric.namespace, which it may be given instead of, never beside.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
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
            raise PydanticCustomError(
                "prompt_batch",
                "batched prompts are not supported: send one "
                "prompt (a string or a list of token ids) per request",
            )
        bad = [t for t in v if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            raise PydanticCustomError(
                "prompt_ids", "token ids must be integers, got {bad}", {"bad": _json_repr(bad[0])}
            )
        return v


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from a cache (kvfabric says from which)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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
    logits_digest: str  # "" unless the request asked for it
    token_ids: list[int]
    retries: int = 0  # replicas that died under it; the ingress retried elsewhere
    fetched_bytes: int = 0  # KV bytes its remote fetch moved, as the model server counts them


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
    raise ValueError(f"{name} is not valid JSON")  # json.loads accepts NaN/Infinity otherwise


async def read_json(request: Request, limit: int) -> Any:
    too_large = APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():  # a missing or lying Content-Length too
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # bad syntax, bad encoding, huge ints, deep nesting
        _bad(f"request body is not valid JSON: {e}", code="invalid_json")


def parse_completion(body: Any) -> CompletionRequest:
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


def check_supported(req: CompletionRequest) -> None:
    if req.stream:
        _bad(
            "streaming is not supported: send stream=false",
            code="unsupported_parameter",
            param="stream",
        )
    if req.temperature not in (None, 0):
        _bad(
            f"only greedy decoding is supported: temperature must be 0 or null, "
            f"got {req.temperature}",
            code="unsupported_parameter",
            param="temperature",
        )
    neutral = {
        "n": req.n in (None, 1),
        "best_of": req.best_of in (None, 1),
        "top_p": req.top_p in (None, 1),
        "presence_penalty": req.presence_penalty in (None, 0),
        "frequency_penalty": req.frequency_penalty in (None, 0),
        "echo": not req.echo,
        "logprobs": req.logprobs is None,
        "stop": not req.stop,
        "suffix": not req.suffix,
        "logit_bias": not req.logit_bias,
        "stream_options": req.stream_options is None,
    }
    for name, ok in neutral.items():
        if not ok:
            _bad(
                f"{name}={_json_repr(getattr(req, name))} is not supported: this server "
                f"decodes greedily, one choice per request, without logprobs or stop sequences",
                code="unsupported_parameter",
                param=name,
            )


# --- the response ---------------------------------------------------------------------
def completion_response(
    result: GenerateResult, model_name: str, tokenizer: ByteTokenizer
) -> CompletionResponse:
    if not isinstance(result, GenerateResult):
        raise TypeError(f"backend returned {type(result).__name__}, not a GenerateResult")
    ids = [int(t) for t in result.tokens]
    return CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model_name,
        # No end-of-text token: every completion runs to max_tokens.
        choices=[CompletionChoice(index=0, text=tokenizer.decode(ids), finish_reason="length")],
        usage=Usage(
            prompt_tokens=result.prompt_tokens,
            completion_tokens=len(ids),
            total_tokens=result.prompt_tokens + len(ids),
            prompt_tokens_details=PromptTokensDetails(cached_tokens=result.cached_tokens),
        ),
        kvfabric=KVFabricInfo(
            cached_tokens=result.cached_tokens,
            device_tokens=result.device_tokens,
            host_tokens=result.host_tokens,
            remote_tokens=result.remote_tokens,
            fetch=result.fetch,
            ttft_ms=result.ttft_s * 1e3,
            node=result.node,
            logits_digest=result.logits_digest,
            token_ids=ids,
            retries=result.retries,
            fetched_bytes=result.fetched_bytes,
        ),
    )
