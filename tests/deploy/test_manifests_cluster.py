"""The cluster launcher's manifest stays true to the code: deploy/manifests/cluster.yaml passes
Ray's own validation, pins the Ray and Python versions pyproject.toml pins, installs the project
with vLLM, and tells the user to run `kvfabric up` with a tenant table and token auth; and every
`kvfabric` subcommand a manifest names exists. The KubeRay manifests:
tests/deploy/test_manifests_rayservice.py."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from tests.deploy.manifest_files import (
    CLUSTER,
    RAYSERVICES,
    ROOT,
    cli_parsers,
    py_tag,
    ray_version,
    read_pyproject,
    resolve,
)


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return read_pyproject()


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load(CLUSTER.read_text())


# ------------------------------------------------------------------ cluster launcher


def test_cluster_config_passes_the_launchers_validation(cluster):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cluster)))  # what `ray up` does first


def test_cluster_has_a_cpu_head_and_gpu_workers(cluster, pyproject):
    assert cluster["provider"]["type"] == "aws"
    assert cluster["provider"]["region"] == "us-west-2"
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert head.get("resources", {}).get("GPU", 0) == 0
    workers = {k: v for k, v in types.items() if k != cluster["head_node_type"]}
    gpu = {k: v for k, v in workers.items() if v.get("resources", {}).get("GPU", 0) >= 1}
    assert gpu, "no worker node type offers a GPU"
    for name, t in gpu.items():
        assert 0 <= t["min_workers"] <= t["max_workers"] <= cluster["max_workers"], name
    base = f"rayproject/ray:{ray_version(pyproject)}-{py_tag(pyproject)}"
    assert cluster["docker"]["head_image"] in (base, f"{base}-gpu")
    assert cluster["docker"]["worker_image"] == f"{base}-gpu"


def test_cluster_installs_the_project_from_its_file_mount(cluster):
    mounts = cluster["file_mounts"]
    (remote,) = [r for r, local in mounts.items() if (ROOT / local).resolve() == ROOT]
    setup = " && ".join(cluster["setup_commands"])
    # With vLLM: the extra pyproject.toml declares for it (its CUDA build from PyPI).
    assert re.search(rf"cd {re.escape(remote)} && pip install -e '\.\[vllm\]'", setup), setup


def test_cluster_vllm_app_args_fit_its_nodes_and_model(cluster, pyproject):
    from kvfabric.deploy.cli.main import read_app_args
    from kvfabric.deploy.vllm.serve.app_args import LLMAppArgs

    assert "vllm" in pyproject["project"]["optional-dependencies"]
    (repo,) = [r for r, local in cluster["file_mounts"].items() if (ROOT / local).resolve() == ROOT]
    ups = re.findall(r"kvfabric up --engine vllm --args @(\S+)", CLUSTER.read_text())
    assert ups, "cluster.yaml tells the user how to start the vLLM app"
    for remote in ups:
        assert remote.startswith(repo + "/"), f"{remote} is not in the synced repository {repo}"
        args = LLMAppArgs.from_dict(read_app_args("@" + str(ROOT / remote[len(repo) + 1 :])))
        # The model folder the engines load is the one every node downloads in setup, in the
        # container's home (rayproject images run as `ray`).
        (folder,) = re.findall(r"--local-dir (\S+)", " ".join(cluster["setup_commands"]))
        assert args.model_dir == folder.replace("~", "/home/ray", 1)
        gpu = [
            t for t in cluster["available_node_types"].values() if t.get("resources", {}).get("GPU")
        ]
        assert args.replicas == sum(t["min_workers"] for t in gpu), "one engine per GPU worker"
        for t in gpu:
            assert 0 < args.gpus_per_replica <= t["resources"]["GPU"]
            assert args.cpus_per_replica < t["resources"]["CPU"]


def _with_home(path: str) -> str:
    return re.sub(r"^\$(HOME|\{HOME\})/", "~/", path)


def test_cluster_gives_kvfabric_up_a_mounted_tenant_table(cluster):
    mounted = {_with_home(r) for r in cluster["file_mounts"]}
    text = CLUSTER.read_text()
    ups = re.findall(r"kvfabric up\b([^'\n]*)", text)
    assert ups, "cluster.yaml tells the user to run `kvfabric up`"
    for args in ups:
        m = re.search(r"--tenants\s+(\S+)", args)
        assert m, f"`kvfabric up{args}` runs without API keys"
        assert _with_home(m.group(1)) in mounted, f"{m.group(1)} is not a file mount"
    assert (
        "--tenants"
        in cli_parsers(resolve("kvfabric.deploy.cli.main:main"))["up"]._option_string_actions
    )


def test_cluster_start_commands_keep_token_auth(cluster):
    mounted = {_with_home(r) for r in cluster["file_mounts"]}
    for key, flag in (
        ("head_start_ray_commands", "--head"),
        ("worker_start_ray_commands", "--address="),
    ):
        (start,) = [c for c in cluster[key] if "ray start" in c]
        assert flag in start, key
        assert re.search(r"\bRAY_AUTH_MODE=token\b", start), key
        m = re.search(r"\bRAY_AUTH_TOKEN_PATH=(\S+?);", start)
        assert m and _with_home(m.group(1)) in mounted, f"{key}: the token file is not a file mount"
    head = next(c for c in cluster["head_start_ray_commands"] if "ray start" in c)
    assert "--dashboard-host=0.0.0.0" in head


# ------------------------------------------------------------------ the kvfabric command


def test_kvfabric_commands_in_manifests_exist(pyproject):
    used = set()
    for path in (*RAYSERVICES.values(), CLUSTER):
        used |= set(re.findall(r"(?<![\w./-])kvfabric[ \t]+([a-z][\w-]*)", path.read_text()))
    assert "up" in used, "cluster.yaml tells the user to run `kvfabric up`"
    target = pyproject["project"]["scripts"]["kvfabric"]
    assert target == "kvfabric.deploy.cli.main:main"
    main = resolve(target)
    assert callable(main)
    missing = used - set(cli_parsers(main))
    assert not missing, f"`kvfabric` has no subcommand(s) {sorted(missing)}"
