"""Where the connector's copy thread runs on a CPU engine: off the cores vLLM binds the
forward's OpenMP threads to (copy_cores.py)."""

import os
import threading

import pytest
from kvfabric.deploy.vllm.connector.copy_cores import copy_cores, omp_cores, parse_cpus


def sysfs(tmp_path, online: str, nodes: list[str]):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "online").write_text(online + "\n")
    for i, cpus in enumerate(nodes):
        (tmp_path / "node" / f"node{i}").mkdir(parents=True)
        (tmp_path / "node" / f"node{i}" / "cpulist").write_text(cpus + "\n")
    return tmp_path


def test_cpu_lists_parse_as_linux_writes_them():
    assert parse_cpus("0-3,8,10-14:2") == {0, 1, 2, 3, 8, 10, 12, 14}
    assert parse_cpus("5") == {5}
    for bad in ("a", "3-1", "0-4:0", "1,,x"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_each_way_vllm_binds_openmp_is_read():
    assert omp_cores({"GOMP_CPU_AFFINITY": "0 1 2"}) == {0, 1, 2}
    assert omp_cores({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,5]"}) == {4, 5}
    assert omp_cores({"OMP_PLACES": "{2,3}", "OMP_PROC_BIND": "true"}) == {2, 3}
    assert omp_cores({"OMP_PLACES": "{0:4:2}", "OMP_PROC_BIND": "true"}) == {0, 2, 4, 6}
    assert omp_cores({"OMP_PLACES": "{2,3}"}) is None  # places without binding bind nothing
    assert omp_cores({}) is None
    assert omp_cores({"GOMP_CPU_AFFINITY": "zero"}) is None  # unreadable: leave it alone


def test_the_copies_go_to_the_reserved_cores_of_this_workers_numa_node(tmp_path):
    sys = sysfs(tmp_path, "0-7", ["0-3", "4-7"])
    auto = {"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}
    assert copy_cores(auto, sys) == {3}  # not 4-7: another rank's node under auto binding
    # Listed binds name every rank's cores: none of them.
    listed = {"GOMP_CPU_AFFINITY": "0,1", "VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    assert copy_cores(listed, sys) is None  # node 0's cores are all taken
    listed["VLLM_CPU_OMP_THREADS_BIND"] = "0-1|4-5"
    assert copy_cores(listed, sys) == {2, 3}
    assert copy_cores({"OMP_PLACES": "{0-3}", "OMP_PROC_BIND": "true"}, sys) is None
    assert copy_cores({}, sys) is None  # nothing bound: the thread stays where it is


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_copy_thread_leaves_the_forwards_core(monkeypatch):
    from kvfabric.deploy.vllm.connector.copy_cores import leave_the_forward

    first = min(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_PLACES", f"{{{first}}}")
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    seen: list[set[int]] = []
    thread = threading.Thread(
        target=lambda: (leave_the_forward(), seen.append(os.sched_getaffinity(0)))
    )
    thread.start()
    thread.join(timeout=10)
    assert seen and first not in seen[0]
    assert first in os.sched_getaffinity(0)  # only that thread moved
