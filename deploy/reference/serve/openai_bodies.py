"""The OpenAI ingress's request and response bodies: what a /v1/completions body may be,
read and checked before anything else sees it (a body too large, not JSON, of the wrong
shape or asking what this server does not do is refused with an OpenAI-style 4xx), and
the completion built from a model server's result."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Iterable, Iterator, Literal, NoReturn, TypeVar

from fastapi import Request
from kvfabric.deploy.reference.tokenizer import ByteTokenizer
from kvfabric.deploy.serving.openai_errors import APIError
from kvfabric.deploy.serving.openai_errors import bad_request as _bad
from kvfabric.deploy.serving.protocol import GenerateResult, PrefixFetch
from kvfabric.deploy.serving.tenants import MAX_NAME_CHARS
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
R = TypeVar("R", bound="SamplingRequest")


# --- request and response bodies --------------------------------------------------------
class KVFabricOptions(BaseModel):
    """The `kvfabric` extension object of a completion request."""

    model_config = ConfigDict(extra="forbid", strict=True)
    namespace: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    cache: bool = True  # the namespace must be one the caller's API key grants
    # Answer a hash of every step's logits, to check outputs bit for bit (the demo and
    # the chaos harness ask): it keeps and copies every step's logits, so only on request.
    logits_digest: bool = False


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False  # a last chunk with the usage (and no choices)


class SamplingRequest(BaseModel):
    """What /v1/completions and /v1/chat/completions bodies share. Strict: JSON `true` is
    no int and `"16"` no number."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # None: the route's default (DEFAULT_MAX_TOKENS for completions; for a chat, as many
    # as the server's limit and the model's positions allow).
    default_max_tokens: ClassVar[int | None] = None
    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(
        default=None, max_length=MAX_NAME_CHARS
    )  # OpenAI's end-user id: not a namespace
    kvfabric: KVFabricOptions | None = None
    # The request's namespace as vLLM's clients name it (the vLLM app's own field): the
    # same as kvfabric.namespace, which it may be given instead of, never beside.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)
    # OpenAI sampling parameters: accepted at the value that keeps decoding greedy
    # and single-choice (clients often send the defaults), refused otherwise rather
    # than silently ignored. Greedy decoding is deterministic, so any seed is fine.
    n: int | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None

    def neutral(self) -> dict[str, bool]:
        """Each parameter this server does not do: whether it has the value that asks
        nothing of it."""
        return {
            "n": self.n in (None, 1),
            "top_p": self.top_p in (None, 1),
            "presence_penalty": self.presence_penalty in (None, 0),
            "frequency_penalty": self.frequency_penalty in (None, 0),
            "stop": not self.stop,
            "logit_bias": not self.logit_bias,
        }

    def token_limit(self) -> int | None:
        return self.max_tokens


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    default_max_tokens: ClassVar[int | None] = DEFAULT_MAX_TOKENS
    prompt: str | list[int]
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def neutral(self) -> dict[str, bool]:
        return super().neutral() | {
            "best_of": self.best_of in (None, 1),
            "echo": not self.echo,
            "logprobs": self.logprobs is None,
            "suffix": not self.suffix,
        }

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


class TextPart(BaseModel):
    """A message content part: text only (the model reads no images or audio)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = Field(default=None, max_length=MAX_NAME_CHARS)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=0)  # OpenAI's newer max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def neutral(self) -> dict[str, bool]:
        return super().neutral() | {
            "logprobs": not self.logprobs,
            "top_logprobs": self.top_logprobs is None,
        }

    def token_limit(self) -> int | None:
        given = {self.max_tokens, self.max_completion_tokens} - {None}
        if len(given) > 1:
            _bad(
                "max_tokens and max_completion_tokens differ: give one",
                param="max_completion_tokens",
            )
        return given.pop() if given else None

    def turns(self) -> list[tuple[str, str]]:
        """(role, text) in the model's chat roles."""
        return [("system" if m.role == "developer" else m.role, m.text()) for m in self.messages]


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


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
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


def parse_body(body: Any, kind: type[R]) -> R:
    """`body` as a request of `kind`, or a 400 naming the first fields at fault."""
    if not isinstance(body, dict):
        _bad(f"request body must be a JSON object, got {_json_repr(body)}", code="invalid_body")
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)
        parts = [f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in errors[:3]]
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
        _bad("invalid request: " + "; ".join(parts) + more, code="invalid_body", param=param)


def check_supported(req: SamplingRequest) -> None:
    if req.stream_options is not None and not req.stream:
        _bad("stream_options needs stream=true", param="stream_options")
    if req.temperature not in (None, 0):
        _bad(
            f"only greedy decoding is supported: temperature must be 0 or null, "
            f"got {req.temperature}",
            code="unsupported_parameter",
            param="temperature",
        )
    for name, ok in req.neutral().items():
        if not ok:
            _bad(
                f"{name}={_json_repr(getattr(req, name))} is not supported: this server "
                f"decodes greedily, one choice per request, without logprobs or stop sequences",
                code="unsupported_parameter",
                param=name,
            )


# --- the response ---------------------------------------------------------------------
def completion_response(
    result: GenerateResult, model_name: str, tokenizer: ByteTokenizer, chat: bool = False
) -> CompletionResponse | ChatCompletionResponse:
    """The answer to a completion (or, `chat`, a chat completion) from the model server's
    result. No end-of-text token: every answer runs to max_tokens."""
    if not isinstance(result, GenerateResult):
        raise TypeError(f"backend returned {type(result).__name__}, not a GenerateResult")
    ids = [int(t) for t in result.tokens]
    text = tokenizer.decode(ids)
    created = int(time.time())
    usage = Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=len(ids),
        total_tokens=result.prompt_tokens + len(ids),
        prompt_tokens_details=PromptTokensDetails(cached_tokens=result.cached_tokens),
    )
    info = KVFabricInfo(
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
    )
    if chat:
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=created,
            model=model_name,
            choices=[
                ChatChoice(index=0, message=AssistantMessage(content=text), finish_reason="length")
            ],
            usage=usage,
            kvfabric=info,
        )
    return CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=created,
        model=model_name,
        choices=[CompletionChoice(index=0, text=text, finish_reason="length")],
        usage=usage,
        kvfabric=info,
    )


def stream_chunks(
    answer: CompletionResponse | ChatCompletionResponse,
    pieces: Iterable[str],
    include_usage: bool,
) -> Iterator[dict[str, Any]]:
    """`answer` as the chunks of an OpenAI stream: its text in `pieces`, then the finish
    reason (with the `kvfabric` extension), then, if asked, the usage with no choices."""
    chat = isinstance(answer, ChatCompletionResponse)
    head = {
        "id": answer.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": answer.created,
        "model": answer.model,
    }

    def choice(text: str | None, finish: str | None) -> dict[str, Any]:
        if chat:
            delta = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

    if chat:
        yield head | {
            "choices": [{**choice("", None), "delta": {"role": "assistant", "content": ""}}]
        }
    for piece in pieces:
        if piece:
            yield head | {"choices": [choice(piece, None)]}
    finish = answer.choices[0].finish_reason
    yield head | {"choices": [choice(None, finish)], "kvfabric": answer.kvfabric.model_dump()}
    if include_usage:
        yield head | {"choices": [], "usage": answer.usage.model_dump()}
