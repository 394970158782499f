"""What the fabric's request routers read of a request: the reference server's
GenerateRequest, and Ray Serve LLM's OpenAI requests through the model's tokenizer.
Anything else is left to Serve (None), never an error."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from kvfabric.deploy.serving.protocol import GenerateRequest
from kvfabric.deploy.serving.router import GenerateRequestPrompts, RoutedPrompt

pytest.importorskip("transformers")

from kvfabric.deploy.serving.cache_namespace import cache_namespace  # noqa: E402
from kvfabric.deploy.vllm.serve.llm_router import MAX_PROMPT_CHARS, OpenAIPrompts  # noqa: E402
from kvfabric.deploy.vllm.serve.model import ensure_tiny_model  # noqa: E402


@dataclass
class Metadata:  # the field of Serve's RequestMetadata a router reads
    multiplexed_model_id: str = ""


@dataclass
class Pending:  # the fields of Serve's PendingRequest a router reads
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    metadata: Metadata = field(default_factory=Metadata)


@dataclass
class Completion:  # the fields of vLLM's CompletionRequest the router reads
    prompt: object = None
    cache_salt: str | None = None
    model: str | None = None


@dataclass
class Chat:
    messages: object = None
    cache_salt: str | None = None


@pytest.fixture(scope="module")
def openai() -> OpenAIPrompts:
    reader = OpenAIPrompts()
    reader.load_tokenizer(str(ensure_tiny_model()))
    return reader


def read(reader, *args, **kwargs) -> RoutedPrompt | None:
    return asyncio.run(reader.prompt_of(Pending(list(args), kwargs)))


def test_a_generate_request_is_read_as_its_tokens():
    req = GenerateRequest(tokens=(1, 2, 3), max_tokens=1, namespace="t")
    assert read(GenerateRequestPrompts(), "x", req) == RoutedPrompt((1, 2, 3), "t")
    off = GenerateRequest(tokens=(1, 2, 3), max_tokens=1, namespace="t", use_cache=False)
    assert read(GenerateRequestPrompts(), off) is None
    assert read(GenerateRequestPrompts(), "not a request", 7) is None


def test_a_completion_is_read_with_the_models_tokenizer(openai):
    got = read(openai, Completion("hello world"))
    assert got == RoutedPrompt(openai.tokenizer("hello world")["input_ids"], cache_namespace(None))
    assert got.tokens and all(isinstance(t, int) for t in got.tokens)
    # The tenant is the cache_salt, kept apart from no salt.
    assert read(openai, Completion("hello world", "default")).namespace == cache_namespace(
        "default"
    )
    assert read(openai, Completion([5, 6, 7])) == RoutedPrompt([5, 6, 7], cache_namespace(None))


def test_a_lora_adapter_s_request_is_left_to_serve(openai):
    """Its pages lie under its adapter's namespace, which the router cannot name: ranked
    under its salt's, it would go where pages it cannot use lie."""
    assert read(openai, Completion("hello", model="base-model")) is not None
    assert read(openai, Completion("hello", model="base-model:sql-adapter")) is None
    adapter = Pending([Completion("hello")], {}, Metadata("base-model:sql-adapter"))
    assert asyncio.run(openai.prompt_of(adapter)) is None


@pytest.mark.parametrize(
    "prompt",
    [["a", "b"], [[1, 2]], [], [1, -2], [1, True], {"a": 1}, 3.5, "x" * (MAX_PROMPT_CHARS + 1)],
)
def test_what_the_router_does_not_read_is_left_to_serve(openai, prompt):
    assert read(openai, Completion(prompt)) is None


@pytest.mark.parametrize(
    "messages",
    [[{"role": "user", "content": "hi"}], [{"role": "user", "content": [1]}], "hi", None],
)
def test_a_chat_without_a_template_is_left_to_serve(messages):
    # A model whose tokenizer has no chat template (the bundled one has one): the engine
    # would refuse the chat, so the router does not read it either.
    reader = OpenAIPrompts()
    reader.load_tokenizer(str(ensure_tiny_model()))
    reader.tokenizer.chat_template = None
    assert read(reader, Chat(messages)) is None


def test_the_bundled_model_s_chat_is_read_through_its_own_template(openai):
    messages = [{"role": "user", "content": "hi"}]
    routed = read(openai, Chat(messages))
    assert routed is not None
    text = openai.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert text == "<|user|>hi\n<|assistant|>"
    assert list(routed.tokens) == openai.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_chat_is_read_through_the_chat_template():
    reader = OpenAIPrompts()
    reader.load_tokenizer(str(ensure_tiny_model()))
    reader.tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    )
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = reader.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert text == "<system>be brief<user>hello"
    want = reader.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert read(reader, Chat(messages, "a")) == RoutedPrompt(list(want), cache_namespace("a"))
    assert read(reader, Chat([{"role": "user", "content": [{"type": "image_url"}]}])) is None
