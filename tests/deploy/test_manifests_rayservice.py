"""The KubeRay manifests stay true to the code: deploy/manifests/rayservice.yaml and
rayservice-vllm.yaml (RayServices: the reference model's app and vLLM's) name things that live
elsewhere: the Serve app's import path and args, the pinned Ray and Python versions, the runtime
dependencies, the secrets. These tests parse both and check every such name against the code,
pyproject.toml and Ray's own validators, so a rename or a version bump cannot leave a manifest
quietly broken. The cluster launcher's manifest: tests/deploy/test_manifests_cluster.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.manifest_files import (
    GPU,
    RAYSERVICES,
    project_deps,
    py_tag,
    ray_version,
    read_pyproject,
    resolve,
)


@dataclasses.dataclass(frozen=True)
class AppKind:
    """What a Serve app's import path implies: its args' class and the pyproject extras its
    nodes install beside the runtime dependencies."""

    args_class: str
    extras: tuple[str, ...]
    engine: str  # `kvfabric up --engine`


APPS = {
    "kvfabric.deploy.reference.serve.app:app_builder": AppKind(
        "kvfabric.deploy.reference.serve.app:AppArgs", (), "reference"
    ),
    "kvfabric.deploy.vllm.serve.serve_llm:llm_app_builder": AppKind(
        "kvfabric.deploy.vllm.serve.app_args:LLMAppArgs", ("vllm",), "vllm"
    ),
}


# ------------------------------------------------------------------ loading


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return read_pyproject()


@pytest.fixture(scope="module", params=sorted(RAYSERVICES))
def rayservice_path(request) -> Path:
    return RAYSERVICES[request.param]


@pytest.fixture(scope="module")
def rayservice(rayservice_path) -> dict:
    return yaml.safe_load(rayservice_path.read_text())


@pytest.fixture(scope="module")
def serve_config(rayservice) -> dict:
    # KubeRay takes serveConfigV2 as a YAML document inside a string.
    raw = rayservice["spec"]["serveConfigV2"]
    assert isinstance(raw, str), "serveConfigV2 must be a YAML string (a `|` block)"
    return yaml.safe_load(raw)


def _pod_specs(rayservice) -> list[tuple[str, dict]]:
    """(group name, pod spec) for the head and every worker group."""
    rc = rayservice["spec"]["rayClusterConfig"]
    out = [("head", rc["headGroupSpec"]["template"]["spec"])]
    out += [(g["groupName"], g["template"]["spec"]) for g in rc["workerGroupSpecs"]]
    return out


def _containers(pod_spec: dict) -> list[dict]:
    return list(pod_spec.get("initContainers", [])) + list(pod_spec["containers"])


# ------------------------------------------------------------------ RayService


def test_rayservice_is_a_kuberay_rayservice(rayservice, pyproject):
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert rayservice["kind"] == "RayService"
    assert rayservice["metadata"]["name"]
    rc = rayservice["spec"]["rayClusterConfig"]
    assert rc["rayVersion"] == ray_version(pyproject)
    assert rc["headGroupSpec"]["template"]["spec"]["containers"]
    assert rc["workerGroupSpecs"]


def _app(serve_config) -> tuple[dict, AppKind]:
    (app,) = serve_config["applications"]
    return app, APPS[app["import_path"]]


def test_serve_config_is_one_valid_serve_application(serve_config):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config)  # Ray Serve's own config schema
    (app,) = serve_config["applications"]
    assert app["import_path"] in APPS
    assert callable(resolve(app["import_path"]))
    assert app["route_prefix"] == "/"
    assert serve_config.get("http_options", {}).get("port", 8000) == 8000


def test_app_args_build_the_apps_args(serve_config):
    app, kind = _app(serve_config)
    cls = resolve(kind.args_class)
    fields = set(cls.model_fields)
    args = app.get("args", {})
    assert "shards" in args
    assert set(args) <= fields, f"unknown app args: {sorted(set(args) - fields)}"
    cls.from_dict(args)  # validated as the app builder validates them
    if "llm_config" in args:
        pytest.importorskip("vllm")
        from kvfabric.deploy.vllm.serve.serve_llm import with_fabric
        from ray.serve.llm import LLMConfig

        with_fabric(LLMConfig.model_validate(args["llm_config"]))  # Ray's own validator


@dataclasses.dataclass(frozen=True)
class Engines:
    """What a vLLM app's args say about its engines, in either form (LLMAppArgs' own
    fields, or the user's LLMConfig under `llm_config`)."""

    replicas: int
    gpus: float
    cpus: float
    model_dir: str

    @classmethod
    def of(cls, args: dict) -> "Engines":
        own = args.get("llm_config")
        if own is None:
            return cls(
                args["replicas"],
                args["gpus_per_replica"],
                args["cpus_per_replica"],
                args["model_dir"],
            )
        (bundle,) = own["placement_group_config"]["bundles"]
        return cls(
            own["deployment_config"]["num_replicas"],
            bundle.get("GPU", 0),
            bundle["CPU"],
            own["model_loading_config"]["model_source"],
        )


def _workers(rayservice) -> list[dict]:
    return rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def test_model_server_replicas_fit_the_cluster(serve_config, rayservice):
    app, kind = _app(serve_config)
    args = app["args"]
    workers = sum(g["replicas"] for g in _workers(rayservice))
    if kind.engine == "reference":
        # At most one model server per Ray node: `nodes`, when set, is the head plus every worker.
        assert args.get("nodes") in (None, 0, 1 + workers), (
            f"nodes={args.get('nodes')}, {1 + workers} nodes"
        )
        return
    # One vLLM engine per GPU worker (the head has none), each within its worker's GPUs and CPUs.
    engines = Engines.of(args)
    assert engines.replicas == workers
    for g in _workers(rayservice):
        (c,) = g["template"]["spec"]["containers"]
        assert 0 < engines.gpus <= int(c["resources"]["limits"][GPU]), g["groupName"]
        assert engines.cpus < float(c["resources"]["limits"]["cpu"]), g["groupName"]


def test_app_args_carry_no_secret(serve_config):
    # serveConfigV2 is stored in plain text in the custom resource: the keys are in a file.
    app, _ = _app(serve_config)
    assert "api_key" not in app["args"]
    assert app["args"].get("tenants_file", "").startswith("/"), "the app runs with API keys"


def _volumes_at(spec: dict, container: dict, path: str) -> list[tuple[dict, dict]]:
    """(volume, mount) of every mount of `container` that holds `path`."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    out = []
    for m in container.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/") + "/"
        if path.startswith(root) and m["name"] in volumes:
            out.append((volumes[m["name"]], m))
    return out


def test_the_tenant_table_is_a_secret_mounted_on_every_pod(
    serve_config, rayservice, rayservice_path
):
    # The ingress replica (and the app builder) may run on any node, so every Ray
    # container reads the table at the path the app args name.
    app, _ = _app(serve_config)
    path = app["args"]["tenants_file"]
    for group, spec in _pod_specs(rayservice):
        for c in spec["containers"]:
            found = [
                (v["secret"]["secretName"], item["key"], m.get("readOnly"))
                for v, m in _volumes_at(spec, c, path)
                if "secret" in v
                for item in v["secret"].get("items", [])
                if f"{m['mountPath'].rstrip('/')}/{item['path']}" == path
            ]
            assert found == [("kvfabric-tenants", "tenants.yaml", True)], (
                f"{group}/{c['name']}: {found}"
            )
    assert (
        "kubectl create secret generic kvfabric-tenants --from-file=tenants.yaml="
        in rayservice_path.read_text()
    )


def test_the_model_folder_is_on_every_pod(serve_config, rayservice):
    # Engines load the weights, the router (any node) the tokenizer, the builder the config.
    app, kind = _app(serve_config)
    if kind.engine != "vllm":
        pytest.skip("the reference model is built in")
    path = Engines.of(app["args"]).model_dir
    for group, spec in _pod_specs(rayservice):
        for c in spec["containers"]:
            found = [
                (v["persistentVolumeClaim"]["claimName"], m.get("readOnly"))
                for v, m in _volumes_at(spec, c, path + "/")
                if "persistentVolumeClaim" in v
            ]
            assert found == [("kvfabric-models", True)], f"{group}/{c['name']}: {found}"


def test_runtime_env_installs_the_project_dependencies(serve_config, pyproject):
    app, kind = _app(serve_config)
    deps = project_deps(pyproject, kind.extras)
    env = app["runtime_env"]
    # The code comes as a zip of the repository at a URL the user sets.
    assert re.fullmatch(r"(https|s3|gs)://\S+\.zip", env["working_dir"]), env["working_dir"]
    pip = {canonicalize_name(r.name): r for r in map(Requirement, env["pip"])}
    # Every runtime dependency but Ray, which the image provides (and must not be reinstalled).
    assert set(pip) == set(deps) - {"ray"}
    for name, req in pip.items():
        assert req.specifier == deps[name].specifier, f"{name}: {req} vs pyproject {deps[name]}"


def test_images_match_the_pinned_ray_and_python(rayservice, pyproject):
    base = f"rayproject/ray:{ray_version(pyproject)}-{py_tag(pyproject)}"
    for group, spec in _pod_specs(rayservice):
        for c in spec["containers"]:
            assert c["image"] in (base, f"{base}-gpu"), f"{group}/{c['name']}: {c['image']}"


def test_head_start_params(rayservice):
    params = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert params["dashboard-host"] == "0.0.0.0"
    # KubeRay wants strings; the head needs CPUs, the fabric puts a node actor on every node.
    assert isinstance(params["num-cpus"], str) and float(params["num-cpus"]) > 0


def test_gpu_worker_groups_request_gpus(rayservice):
    groups = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert groups
    for g in groups:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
        (c,) = g["template"]["spec"]["containers"]
        assert int(c["resources"]["limits"][GPU]) >= 1, g["groupName"]
        assert c["image"].endswith("-gpu"), g["groupName"]
    assert sum(g["replicas"] for g in groups) == 3


def test_auth_env_is_set_on_every_container(rayservice):
    rc = rayservice["spec"]["rayClusterConfig"]
    assert rc["authOptions"]["mode"] == "token"
    secret = rc["authOptions"]["secretName"]
    for group, spec in _pod_specs(rayservice):
        for c in _containers(spec):
            env = {e["name"]: e for e in c.get("env", [])}
            where = f"{group}/{c['name']}"
            assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", where
            token = env.get("RAY_AUTH_TOKEN")
            assert token and "value" not in token, (
                f"{where}: the token comes from a Secret, never inline"
            )
            ref = token["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == (secret, "auth_token"), where


def test_serve_service_exposes_port_8000(rayservice):
    ports = rayservice["spec"]["serveService"]["spec"]["ports"]
    assert any(p["port"] == 8000 and p.get("targetPort", 8000) == 8000 for p in ports)
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"][
        "containers"
    ][0]
    assert {"name": "serve", "containerPort": 8000} in head["ports"]
