"""One script of the `openai` client, run against both apps (the reference model's:
tests/deploy/test_serve_app.py; vLLM's: tests/deploy/vllm/serve/test_serve_llm.py), as a user
who switches between them would: the models, a completion and a chat each asked twice
(the second served from a cache, with equal text), each streamed (the pieces join to the
same text, the usage comes last), the tenant as `cache_salt`."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.waiting import eventually


def run(base_url: str, model: str, prompt: str, api_key: str = "unused") -> dict[str, int]:
    """Asserts as it goes; returns the cached tokens of each repeated request (> 0)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=300)
    assert model in [m.id for m in client.models.list().data]
    salt = {"cache_salt": f"script-{uuid.uuid4().hex[:12]}"}
    ask = {"model": model, "max_tokens": 4, "temperature": 0, "extra_body": salt}
    cached = {}

    def hit(create):
        """`create()` again until a cache serves its prompt (the index learns of new pages
        a moment after the answer)."""
        return eventually(
            lambda: (r := create()).usage.prompt_tokens_details.cached_tokens > 0 and r,
            "an answer served from a cache",
            deadline_s=120,
        )

    first = client.completions.create(prompt=prompt, **ask)
    again = hit(lambda: client.completions.create(prompt=prompt, **ask))
    text = first.choices[0].text
    assert again.choices[0].text == text and first.usage.completion_tokens == 4
    cached["completion"] = again.usage.prompt_tokens_details.cached_tokens
    chunks = list(
        client.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **ask
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == first.usage.prompt_tokens

    messages = [
        {"role": "system", "content": "Answer in kind."},
        {"role": "user", "content": prompt},
    ]
    chat = client.chat.completions.create(messages=messages, **ask)
    chat_again = hit(lambda: client.chat.completions.create(messages=messages, **ask))
    reply = chat.choices[0].message.content
    assert (
        chat.choices[0].message.role == "assistant"
        and chat_again.choices[0].message.content == reply
    )
    cached["chat"] = chat_again.usage.prompt_tokens_details.cached_tokens
    pieces = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **ask
        )
    )
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == reply
    assert pieces[-1].usage.completion_tokens == chat.usage.completion_tokens

    # Another tenant's identical prompt starts cold, and gets the same text.
    other = {**ask, "extra_body": {"cache_salt": f"other-{uuid.uuid4().hex[:12]}"}}
    cold = client.completions.create(prompt=prompt, **other)
    assert cold.choices[0].text == text
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.NotFoundError):
        client.completions.create(prompt=prompt, **{**ask, "model": "no-such-model"})
    return cached
