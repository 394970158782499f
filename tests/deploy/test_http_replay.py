"""The HTTP replay's summary: a request either pass failed counts as failed, not as a
mismatch, and only requests both passes answered give totals and percentiles."""

from kvfabric.deploy.harness.http_replay import Pair, Served, summarize
from kvfabric.deploy.serving.protocol import PrefixFetch


def served(
    node="a", ttft=10.0, ids=(1, 2), remote=0, fetch=PrefixFetch.NONE, fetched_bytes=0
) -> Served:
    return Served(
        cached_tokens=16 + remote,
        device_tokens=16,
        host_tokens=0,
        remote_tokens=remote,
        fetch=fetch,
        ttft_ms=ttft,
        node=node,
        logits_digest="d",
        token_ids=list(ids),
        fetched_bytes=fetched_bytes,
        prompt_tokens=64,
    )


def test_only_requests_both_passes_answered_are_summed():
    pairs = [
        Pair(
            0,
            served(ttft=100.0),
            served(ttft=20.0, node="b", remote=32, fetch=PrefixFetch.FETCHED, fetched_bytes=4096),
        ),
        Pair(1, served(ttft=300.0), served(ttft=40.0, ids=(9,))),
        Pair(2, None, served(ttft=1e6, node="c"), error="baseline failed"),
        Pair(3, served(ttft=1e6), None, error="fabric failed"),
    ]
    r = summarize(pairs)
    assert (r.requests, r.failed_requests, r.output_mismatches) == (4, 2, 1)
    assert (r.prompt_tokens, r.device_hit_tokens, r.remote_hit_tokens) == (128, 32, 32)
    assert (r.remote_fetches, r.remote_fetch_failures, r.remote_bytes, r.nodes_used) == (
        1,
        0,
        4096,
        2,
    )
    assert (r.ttft_p50_ms_fabric, r.ttft_p50_ms_nocache) == (30.0, 200.0)
