"""One Ray cluster of four nodes with the fabric on it, shared by this folder's test
modules (package scope: starting it is most of their time). The index tests run first
(file order): the node tests add and kill node actors, which the index tests' checks of
the directory's node list would race."""

from __future__ import annotations

import shutil

import pytest
from kvfabric.actors.launch import start, stop

from tests.actors.fabric_cluster.cluster_kit import CONFIG, DISK_FOLDER
from tests.ray_cluster import one_cpu_nodes


@pytest.fixture(scope="package")
def cluster():
    with one_cpu_nodes(3) as (c, _):
        yield c


@pytest.fixture(scope="package")
def fabric(cluster):
    f = start(CONFIG, shards=3, cpus_per_actor=0.25, watch_s=0.5)
    yield f
    stop(f)
    shutil.rmtree(DISK_FOLDER, ignore_errors=True)
