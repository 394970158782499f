"""What the OpenAI ingress refuses: every 4xx case with the backend untouched, a bad
configuration, and fuzzed bodies (never a 5xx, never a backend call for an invalid one).
The requests it serves: tests/deploy/test_openai_api.py."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.deploy.reference.model import ModelConfig
from kvfabric.deploy.reference.serve.openai_api import (
    MAX_BODY_BYTES,
    CompletionResponse,
    build_fastapi,
)

from tests.deploy.ingress_backends import (
    CHAT_URL,
    CONFIG,
    KEY,
    LIMIT,
    NAME,
    FakeBackend,
    assert_error,
    chat,
    client_for,
    ok,
    post,
)

# --- every refusal leaves the backend untouched ------------------------------------------
ROOM = CONFIG.max_positions - 2
BAD = [
    (ok(model="gpt-4"), 404, "model_not_found", "gpt-4"),
    (ok(prompt=""), 400, None, "empty"),
    (ok(prompt=[]), 400, None, "empty"),
    (ok(prompt="a" * (ROOM + 1)), 400, "context_length_exceeded", str(ROOM)),
    (ok(prompt=[1] * (ROOM + 1)), 400, "context_length_exceeded", None),
    (ok(prompt="\u00e9" * (ROOM // 2 + 1)), 400, "context_length_exceeded", None),  # 2 bytes each
    (ok(prompt=[1, CONFIG.vocab]), 400, "invalid_token", "512"),
    (ok(prompt=[-1]), 400, "invalid_token", None),
    (ok(prompt=[1, True]), 400, "invalid_body", "integers"),
    (ok(prompt=[1.0]), 400, "invalid_body", "integers"),
    (ok(prompt=["a", "b"]), 400, "invalid_body", "batched"),
    (ok(prompt=[[1, 2]]), 400, "invalid_body", "batched"),
    (ok(prompt=7), 400, "invalid_body", "string or a list"),
    (ok(prompt="a\ud800"), 400, None, "Unicode"),
    (ok(temperature=0.7), 400, "unsupported_parameter", "greedy"),
    (ok(temperature="0"), 400, "invalid_body", "temperature"),
    (ok(stream_options={"include_usage": True}), 400, None, "stream=true"),
    (ok(stream=True, stream_options={"usage": True}), 400, "invalid_body", "stream_options"),
    (ok(stream="no"), 400, "invalid_body", "stream"),
    (ok(max_tokens=-1), 400, "invalid_body", "max_tokens"),
    (ok(max_tokens=LIMIT + 1), 400, None, "limit"),
    (ok(max_tokens="2"), 400, "invalid_body", "max_tokens"),
    (ok(max_tokens=2.0), 400, "invalid_body", "max_tokens"),
    (ok(max_tokens=True), 400, "invalid_body", "max_tokens"),
    (ok(n=2), 400, "unsupported_parameter", "n=2"),
    (ok(stop=["x" * 5000]), 400, "unsupported_parameter", 'stop=["xxx'),
    (ok(top_p=0.5), 400, "unsupported_parameter", "top_p"),
    (ok(stop=["\n"]), 400, "unsupported_parameter", "stop"),
    (ok(logprobs=1), 400, "unsupported_parameter", "logprobs"),
    (ok(echo=True), 400, "unsupported_parameter", "echo"),
    (ok(unknown_field=1), 400, "invalid_body", "unknown_field"),
    (ok(user=5), 400, "invalid_body", "user"),
    (ok(user="u" * 300), 400, "invalid_body", "user"),
    (ok(kvfabric={"namespace": ""}), 400, "invalid_body", "kvfabric.namespace"),
    (ok(kvfabric={"cache": "yes"}), 400, "invalid_body", "kvfabric.cache"),
    (ok(kvfabric={"logits_digest": 1}), 400, "invalid_body", "kvfabric.logits_digest"),
    (ok(kvfabric={"tier": "device"}), 400, "invalid_body", "kvfabric.tier"),
    (ok(kvfabric=[]), 400, "invalid_body", "kvfabric"),
    ({"prompt": "hi"}, 400, "invalid_body", "model"),
    ({"model": NAME}, 400, "invalid_body", "prompt"),
    ([ok()], 400, "invalid_body", "JSON object"),
    (None, 400, "invalid_body", None),
    (b"{not json", 400, "invalid_json", None),
    (b"", 400, "invalid_json", None),
    (b'{"model": "tiny-lm", "prompt": "hi", "temperature": NaN}', 400, "invalid_json", "NaN"),
    (b'{"model": "tiny-lm", "prompt": [' + b"9" * 5000 + b"]}", 400, "invalid_json", None),
    (b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json", None),
    (b"\xff\xfe\x00garbage", 400, "invalid_json", None),
    (b" " * (MAX_BODY_BYTES + 1), 413, "body_too_large", None),
]


@pytest.mark.parametrize("body,status,code,contains", BAD, ids=range(len(BAD)))
def test_refusals_leave_the_backend_untouched(body, status, code, contains):
    backend = FakeBackend()
    r = post(client_for(backend), body)
    assert_error(r, status, code, contains)
    assert backend.calls == []


def test_config_is_validated():
    base = {"backend": FakeBackend(), "model_name": NAME, "model_config": CONFIG, "tenants": None}
    for kw in (
        {"model_name": ""},
        {"max_tokens_limit": 0},
        {"max_tokens_limit": CONFIG.max_positions},
        {"model_config": ModelConfig(vocab=100)},
    ):
        with pytest.raises(ValueError):
            build_fastapi(**{**base, **kw})
    for args in ((object(), NAME, CONFIG, None, LIMIT), (FakeBackend(), NAME, CONFIG, KEY, LIMIT)):
        with pytest.raises(TypeError):  # a key string is no tenant table
            build_fastapi(*args)


# --- fuzzing -----------------------------------------------------------------------------
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "stream",
    "user",
    "kvfabric",
    "n",
    "top_p",
    "stop",
    "seed",
    "echo",
]
FIELD_VALUES = st.one_of(
    JSON,
    st.sampled_from([NAME, "hi", 0, 1, 2, None, True, False, [], {}]),
    st.lists(st.integers(-2, CONFIG.vocab + 1), max_size=6),
    st.fixed_dictionaries({}, optional={"namespace": st.text(max_size=4), "cache": JSON}),
)


@pytest.mark.fuzz
def test_fuzzed_bodies_never_5xx():
    backend = FakeBackend()
    client = client_for(backend)

    @given(
        st.one_of(
            JSON, st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), JSON, max_size=6)
        )
    )
    def garbage(body):
        # Never a valid request: no model named NAME can come out of these.
        r = post(client, body)
        assert 400 <= r.status_code < 500, r.text
        assert "error" in r.json()
        assert backend.calls == []

    @given(
        st.dictionaries(st.sampled_from(FIELDS), FIELD_VALUES, max_size=4),
        st.lists(st.sampled_from(FIELDS), max_size=2),
        st.binary(max_size=8),
    )
    def near_valid(changes, drop, raw):
        body = {k: v for k, v in {**ok(), **changes}.items() if k not in drop}
        before = len(backend.calls)
        r = post(client, body)
        assert r.status_code in (200, 400, 404), r.text
        assert len(backend.calls) == before + (r.status_code == 200)
        if r.status_code == 200 and body.get("stream") is True:
            assert r.text.startswith("data: {") and r.text.endswith("data: [DONE]\n\n"), r.text
        elif r.status_code == 200:
            CompletionResponse.model_validate(r.json())
        else:
            assert set(r.json()["error"]) >= {"message", "type", "code"}
        # Raw bytes are almost never JSON; whatever they are, no 5xx.
        assert post(client, raw).status_code < 500

    @given(
        st.one_of(
            JSON,
            st.dictionaries(st.sampled_from(CHAT_FIELDS) | st.text(max_size=8), JSON, max_size=6),
        )
    )
    def chat_garbage(body):
        before = len(backend.calls)
        r = post(client, body, url=CHAT_URL)
        assert 400 <= r.status_code < 500, r.text
        assert len(backend.calls) == before

    garbage()
    near_valid()
    chat_garbage()


CHAT_FIELDS = ["model", "messages", "max_completion_tokens", "stream", "logprobs", "cache_salt"]
CHAT = [
    (chat(messages=[]), 400, "invalid_body", "messages"),
    (chat(messages="hi"), 400, "invalid_body", "messages"),
    (chat(messages=[{"role": "tool", "content": "x"}]), 400, "invalid_body", "role"),
    (chat(messages=[{"role": "user"}]), 400, "invalid_body", "content"),
    (chat(messages=[{"role": "user", "content": 5}]), 400, "invalid_body", "content"),
    (
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "invalid_body",
        "content",
    ),
    (chat(messages=[{"role": "user", "content": "a\ud800"}]), 400, None, "Unicode"),
    (
        chat(messages=[{"role": "user", "content": "a" * CONFIG.max_positions}]),
        400,
        "context_length_exceeded",
        None,
    ),
    (chat(max_tokens=2, max_completion_tokens=3), 400, None, "differ"),
    (chat(max_tokens=None, max_completion_tokens=LIMIT + 1), 400, None, "limit"),
    (chat(logprobs=True), 400, "unsupported_parameter", "logprobs"),
    (chat(temperature=0.5), 400, "unsupported_parameter", "greedy"),
    (chat(prompt="hi"), 400, "invalid_body", "prompt"),
    (chat(model="gpt-4"), 404, "model_not_found", "gpt-4"),
]


@pytest.mark.parametrize("body,status,code,contains", CHAT, ids=range(len(CHAT)))
def test_chat_refusals_leave_the_backend_untouched(body, status, code, contains):
    backend = FakeBackend()
    r = post(client_for(backend), body, url=CHAT_URL)
    assert_error(r, status, code, contains)
    assert backend.calls == []
