"""The ingress's backend retries a request on another replica when the one serving
it dies, and only then (a unit test at the edge: the Serve handle is a stand-in)."""

from __future__ import annotations

import asyncio

import pytest
from kvfabric.deploy.reference.engine import RequestError
from kvfabric.deploy.reference.serve.backend import HandleBackend
from kvfabric.deploy.serving.protocol import GenerateRequest, GenerateResult
from ray.exceptions import ActorDiedError, ActorUnavailableError

REQ = GenerateRequest(tokens=(1, 2, 3), max_tokens=2, namespace="t")
ANSWER = GenerateResult([4, 5], 3, 0, 0, 0, 0, "none", 0.01, "node-a", "d1")


class FlakyHandle:
    """`generate.remote(req)` raises the scripted errors, one per call, then answers."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors, self.calls = list(errors), 0
        self.generate = self

    def remote(self, req: GenerateRequest):
        self.calls += 1
        error = self.errors.pop(0) if self.errors else None

        async def answer() -> GenerateResult:
            if error is not None:
                raise error
            return ANSWER

        return answer()


def run(backend: HandleBackend) -> GenerateResult:
    return asyncio.run(backend.generate(REQ))


def test_a_dead_replica_costs_a_retry_not_the_request():
    handle = FlakyHandle(ActorDiedError(), ActorUnavailableError("gone", b"\0" * 16))
    result = run(HandleBackend(handle, retries=3, backoff_s=0))
    assert handle.calls == 3 and result.retries == 2 and result.tokens == ANSWER.tokens


def test_an_answer_at_once_reports_no_retry():
    assert run(HandleBackend(FlakyHandle(), backoff_s=0)).retries == 0


def test_retries_are_bounded_and_the_last_error_is_raised():
    handle = FlakyHandle(*[ActorDiedError() for _ in range(5)])
    with pytest.raises(ActorDiedError):
        run(HandleBackend(handle, retries=2, backoff_s=0))
    assert handle.calls == 3


@pytest.mark.parametrize(
    "error", [RequestError("bad prompt"), ValueError("bug"), KeyError("x"), TimeoutError()]
)
def test_errors_of_a_live_replica_are_not_retried(error):
    handle = FlakyHandle(error)
    with pytest.raises(type(error)):
        run(HandleBackend(handle, retries=3, backoff_s=0))
    assert handle.calls == 1
