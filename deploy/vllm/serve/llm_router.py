"""FabricLLMRouter: the fabric's request router for Ray Serve LLM deployments.

Ray Serve LLM hands a replica router the OpenAI request (a completion's `prompt`,
a chat's `messages`), not token ids. The router tokenizes it as the engine will,
with the model's own tokenizer (a chat through its chat template), and asks the
index in the request's cache namespace, that of its `cache_salt`
(serving/cache_namespace.py). A LoRA adapter's request, or a chat with an image, has its
pages under a namespace of the adapter's files or the image, which the router cannot
name: ranked under the salt's, it would go where the base model's or the text's pages
lie, which it cannot use. Those, and anything else it cannot read, are routed by Serve
alone (an adapter's by Serve's multiplexing, to replicas that have it loaded): routing
never fails a request.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvfabric.actors.served import fabrics_of
from kvfabric.deploy.serving.cache_namespace import cache_namespace
from kvfabric.deploy.serving.router import FabricRanking, RoutedPrompt
from ray.serve.request_router import FIFOMixin, PendingRequest

MAX_PROMPT_CHARS = (
    1 << 20
)  # longer text is not tokenized for routing (the engine refuses it anyway)


class OpenAIPrompts:
    """Reads an OpenAI completion or chat request's prompt as token ids."""

    tokenizer: Any = None

    def load_tokenizer(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    async def prompt_of(self, pending: PendingRequest) -> RoutedPrompt | None:
        if getattr(getattr(pending, "metadata", None), "multiplexed_model_id", ""):
            return None  # a LoRA adapter's (Serve multiplexes only those)
        for arg in list(pending.args) + list(pending.kwargs.values()):
            prompt, messages = getattr(arg, "prompt", None), getattr(arg, "messages", None)
            if prompt is None and messages is None:
                continue
            model = getattr(arg, "model", None)
            if isinstance(model, str) and ":" in model:
                return None  # Ray Serve LLM names an adapter `base:adapter`
            tokens = await asyncio.to_thread(self.tokens_of, prompt, messages)
            if tokens is None:
                return None
            return RoutedPrompt(tokens, cache_namespace(getattr(arg, "cache_salt", None)))
        return None

    def tokens_of(self, prompt: Any, messages: Any) -> list[int] | None:
        """The prompt's token ids; None for what the router does not read (a batch of
        prompts, embeddings, a chat without a template)."""
        if isinstance(prompt, str):
            if len(prompt) > MAX_PROMPT_CHARS:
                return None
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if _is_token_ids(prompt):
            return list(prompt)
        if isinstance(messages, list) and getattr(self.tokenizer, "chat_template", None):
            read = [_plain_message(m) for m in messages]
            plain = [m for m in read if m is not None]
            if len(plain) < len(read) or sum(len(m["content"]) for m in plain) > MAX_PROMPT_CHARS:
                return None
            ids = self.tokenizer.apply_chat_template(
                plain, add_generation_prompt=True, tokenize=True
            )
            # transformers 5 answers an encoding (a mapping), 4 a list of ids
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return None


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def _plain_message(message: Any) -> dict[str, str] | None:
    """A chat message with text content as {"role", "content"}; None for anything else."""
    get = message.get if isinstance(message, dict) else lambda k: getattr(message, k, None)
    role, content = get("role"), get("content")
    if isinstance(role, str) and isinstance(content, str):
        return {"role": role, "content": content}
    return None


class FabricLLMRouter(OpenAIPrompts, FIFOMixin, FabricRanking):
    # Ray declares the hook as **kwargs and calls it with the deployment's request_router_kwargs.
    def initialize_state(self, model_dir: str, model_id: str, **cost: float) -> None:  # type: ignore[override]
        """`model_dir`: the model's local folder (its tokenizer gives the token ids);
        `model_id`: the name the engines serve, under which they announce their fabric
        (actors/served.py); `cost`: see `FabricRanking.init_ranking`."""
        self.model_id = model_id
        self.init_ranking(**cost)
        self.load_tokenizer(model_dir)

    def ray_namespace(self) -> str | None:
        # Engines of one name but another KV identity (other CPU kernels) have another
        # fabric; the router asks the first (a miss there only costs a routing choice).
        found = fabrics_of(self.model_id)
        return found[0] if found else None
