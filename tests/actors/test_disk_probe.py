"""A node's disk read bandwidth, measured where it opens its disk tier: a real file read
back; 0 bytes measures nothing; a probe that fails says so and never stops the node."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
from kvfabric.actors.node.disk import DiskConfig, open_store, read_bandwidth
from kvfabric.core.cache import disk_probe
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.cache.pools import PoolCapacity

LAYOUT = KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=4, page_size=2, window=4)
CAPACITIES = {PoolName.FULL: PoolCapacity(4, 0, 8), PoolName.SWA: PoolCapacity(4, 0, 8)}


def test_a_file_read_back_gives_a_positive_rate_and_is_removed(tmp_path: Path):
    rate = disk_probe.read_bytes_per_s(tmp_path, 3 << 20)
    assert rate > 0
    assert list(tmp_path.iterdir()) == []
    # Not a whole number of chunks, and a chunk larger than the file.
    assert disk_probe.read_bytes_per_s(tmp_path, (1 << 20) + 5, chunk=1 << 20) > 0
    assert disk_probe.read_bytes_per_s(tmp_path, 1000, chunk=1 << 20) > 0
    assert list(tmp_path.iterdir()) == []


def test_zero_bytes_measures_nothing_and_writes_nothing(tmp_path: Path):
    assert disk_probe.read_bytes_per_s(tmp_path, 0) == 0.0
    assert list(tmp_path.iterdir()) == []
    config = DiskConfig(str(tmp_path), probe_bytes=0)
    store = open_store("n0", config, LAYOUT, CAPACITIES)
    try:
        assert read_bandwidth(store, config) == 0.0
        assert disk_probe.PROBE_NAME not in {p.name for p in (tmp_path / "n0").iterdir()}
    finally:
        assert store is not None
        store.close()


def test_a_folder_that_cannot_hold_the_probe_gives_0_and_a_warning(tmp_path: Path, caplog):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger=disk_probe.__name__):
        assert disk_probe.read_bytes_per_s(not_a_folder, 1 << 20) == 0.0
    assert "disk read bandwidth" in caplog.text


def test_a_full_disk_leaves_the_rate_unknown_and_the_store_opens(
    tmp_path: Path, caplog, monkeypatch
):
    def full(path: Path, nbytes: int, chunk: int) -> None:
        path.write_bytes(b"half")  # what a full disk took before it refused the rest
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_probe, "_write", full)
    config = DiskConfig(str(tmp_path))
    store = open_store("n0", config, LAYOUT, CAPACITIES)
    assert store is not None
    try:
        with caplog.at_level(logging.WARNING, logger=disk_probe.__name__):
            assert read_bandwidth(store, config) == 0.0
        assert "No space left" in caplog.text
        assert disk_probe.PROBE_NAME not in {p.name for p in store.folder.iterdir()}
    finally:
        store.close()


def test_the_store_s_folder_is_measured_and_no_disk_tier_is_0(tmp_path: Path):
    config = DiskConfig(str(tmp_path), probe_bytes=2 << 20)
    store = open_store("n0", config, LAYOUT, CAPACITIES)
    assert store is not None
    try:
        assert read_bandwidth(store, config) > 0
    finally:
        store.close()
    assert read_bandwidth(None, None) == 0.0
    assert DiskConfig(str(tmp_path)).probe_bytes == 16 << 20
    assert read_bandwidth(None, config) == 0.0


@pytest.mark.parametrize("bad", [-1, 1.5, "16", True, None])
def test_a_bad_probe_size_is_refused_by_its_name(tmp_path: Path, bad):
    with pytest.raises(ValueError, match="probe_bytes"):
        DiskConfig(str(tmp_path), probe_bytes=bad)
