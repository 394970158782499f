"""A fetch that gave up still settles the export's reply when it lands: a grant's lease
is released at once (not at its TTL), and a reply that holds no grant is counted, so a
caller waiting on late replies sees every one of them. No cluster: PeerFetch's callback
with real futures and a peer handle reduced to its `release`."""

import asyncio

import pytest
from kvfabric.actors.node.peer_fetch import PeerFetch
from kvfabric.core.exchange.grant import ExportGrant


class _Releases:
    def __init__(self) -> None:
        self.ids: list[int] = []

    def remote(self, lease_id: int) -> None:
        self.ids.append(lease_id)


class _Peer:
    def __init__(self) -> None:
        self.release = _Releases()


def _fetcher() -> PeerFetch:
    """A PeerFetch whose cache, gate and transport are never reached: settling a late
    reply touches only the peer and the counters."""
    return PeerFetch(None, None, None, lambda: 0, 1.0)  # type: ignore[arg-type]


def _settled(how: str) -> asyncio.Future:
    loop = asyncio.new_event_loop()
    try:
        late = loop.create_future()
        if how == "grant":
            late.set_result(ExportGrant(7, b"f" * 16, 0, ()).encode())
        elif how == "no_lease":
            late.set_result(ExportGrant(0, b"f" * 16, 0, ()).encode())
        elif how == "garbled":
            late.set_result(b"\xc1not a grant")
        elif how == "failed":
            late.set_exception(RuntimeError("the export failed"))
        else:
            late.cancel()
        return late
    finally:
        loop.close()


@pytest.mark.parametrize(
    "how,released,counts",
    [
        ("grant", [7], (1, 0, 0)),
        ("no_lease", [], (0, 1, 0)),
        ("garbled", [], (0, 0, 1)),
        ("failed", [], (0, 0, 1)),
        ("cancelled", [], (0, 0, 1)),
    ],
)
def test_every_late_reply_is_released_or_counted(how, released, counts):
    """Each reply lands in exactly one counter: (released, empty grant, failure)."""
    fetcher, peer = _fetcher(), _Peer()
    fetcher._release_late(peer, _settled(how))
    assert peer.release.ids == released
    assert (fetcher.late_releases, fetcher.late_empty, fetcher.late_failures) == counts
