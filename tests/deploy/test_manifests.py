"""The deployment manifests stay true to the code and to each other.

deploy/manifests/rayservice.yaml and rayservice-vllm.yaml (KubeRay RayServices: the reference
model's app and vLLM's) and deploy/manifests/cluster.yaml (Ray cluster launcher) name things that live elsewhere: the Serve app's import path and args,
the `kvfabric` command, the pinned Ray and Python versions, the runtime dependencies. These
tests parse both files and check every such name against the code, pyproject.toml and Ray's
own validators, so a rename or a version bump cannot leave a manifest quietly broken."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "manifests"
RAYSERVICES = {"reference": MANIFESTS / "rayservice.yaml", "vllm": MANIFESTS / "rayservice-vllm.yaml"}
CLUSTER = MANIFESTS / "cluster.yaml"
GPU = "nvidia.com/gpu"


@dataclasses.dataclass(frozen=True)
class AppKind:
    """What a Serve app's import path implies: its args' class and the pyproject extras its
    nodes install beside the runtime dependencies."""
    args_class: str
    extras: tuple[str, ...]
    engine: str                     # `kvfabric up --engine`


APPS = {"kvfabric.deploy.serve.app:app_builder": AppKind("kvfabric.deploy.serve.app:AppArgs", (), "reference"),
        "kvfabric.deploy.vllm.serve_llm:llm_app_builder": AppKind("kvfabric.deploy.vllm.serve_llm:LLMAppArgs", ("vllm-cuda",), "vllm")}


# ------------------------------------------------------------------ loading

@pytest.fixture(scope="module")
def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


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


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load(CLUSTER.read_text())


def _deps(pyproject, extras: tuple[str, ...] = ()) -> dict[str, Requirement]:
    """The runtime dependencies and those of `extras`, by canonical name."""
    reqs = [Requirement(d) for d in pyproject["project"]["dependencies"]]
    for extra in extras:
        reqs += [Requirement(d) for d in pyproject["project"]["optional-dependencies"][extra]]
    return {canonicalize_name(r.name): r for r in reqs}


def _ray_version(pyproject) -> str:
    spec = [s for s in _deps(pyproject)["ray"].specifier if s.operator == "=="]
    assert len(spec) == 1, "pyproject pins ray with =="
    return spec[0].version


def _py_tag(pyproject) -> str:
    m = re.search(r">=\s*3\.(\d+)", pyproject["project"]["requires-python"])
    assert m, "requires-python has a lower bound"
    return f"py3{m.group(1)}"


def _pod_specs(rayservice) -> list[tuple[str, dict]]:
    """(group name, pod spec) for the head and every worker group."""
    rc = rayservice["spec"]["rayClusterConfig"]
    out = [("head", rc["headGroupSpec"]["template"]["spec"])]
    out += [(g["groupName"], g["template"]["spec"]) for g in rc["workerGroupSpecs"]]
    return out


def _containers(pod_spec: dict) -> list[dict]:
    return list(pod_spec.get("initContainers", [])) + list(pod_spec["containers"])


def _resolve(import_path: str):
    module, _, attr = import_path.partition(":")
    assert module and attr, f"{import_path!r} is not module:attribute"
    return getattr(importlib.import_module(module), attr)


# ------------------------------------------------------------------ RayService

def test_rayservice_is_a_kuberay_rayservice(rayservice, pyproject):
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert rayservice["kind"] == "RayService"
    assert rayservice["metadata"]["name"]
    rc = rayservice["spec"]["rayClusterConfig"]
    assert rc["rayVersion"] == _ray_version(pyproject)
    assert rc["headGroupSpec"]["template"]["spec"]["containers"]
    assert rc["workerGroupSpecs"]


def _app(serve_config) -> tuple[dict, AppKind]:
    (app,) = serve_config["applications"]
    return app, APPS[app["import_path"]]


def test_serve_config_is_one_valid_serve_application(serve_config):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config)    # Ray Serve's own config schema
    (app,) = serve_config["applications"]
    assert app["import_path"] in APPS
    assert callable(_resolve(app["import_path"]))
    assert app["route_prefix"] == "/"
    assert serve_config.get("http_options", {}).get("port", 8000) == 8000


def test_app_args_build_the_apps_args(serve_config):
    app, kind = _app(serve_config)
    cls = _resolve(kind.args_class)
    fields = {f.name for f in dataclasses.fields(cls)}
    args = app.get("args", {})
    assert "shards" in args
    assert set(args) <= fields, f"unknown app args: {sorted(set(args) - fields)}"
    cls.from_dict(args)      # validated as the app builder validates them


def _workers(rayservice) -> list[dict]:
    return rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def test_model_server_replicas_fit_the_cluster(serve_config, rayservice):
    app, kind = _app(serve_config)
    args = app["args"]
    workers = sum(g["replicas"] for g in _workers(rayservice))
    if kind.engine == "reference":
        # At most one model server per Ray node: `nodes`, when set, is the head plus every worker.
        assert args.get("nodes") in (None, 0, 1 + workers), f"nodes={args.get('nodes')}, {1 + workers} nodes"
        return
    # One vLLM engine per GPU worker (the head has none), each within its worker's GPUs and CPUs.
    assert args["replicas"] == workers
    for g in _workers(rayservice):
        (c,) = g["template"]["spec"]["containers"]
        assert 0 < args["gpus_per_replica"] <= int(c["resources"]["limits"][GPU]), g["groupName"]
        assert args["cpus_per_replica"] < float(c["resources"]["limits"]["cpu"]), g["groupName"]


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


def test_the_tenant_table_is_a_secret_mounted_on_every_pod(serve_config, rayservice, rayservice_path):
    # The ingress replica (and the app builder) may run on any node, so every Ray
    # container reads the table at the path the app args name.
    app, _ = _app(serve_config)
    path = app["args"]["tenants_file"]
    for group, spec in _pod_specs(rayservice):
        for c in spec["containers"]:
            found = [(v["secret"]["secretName"], item["key"], m.get("readOnly"))
                     for v, m in _volumes_at(spec, c, path) if "secret" in v
                     for item in v["secret"].get("items", [])
                     if f"{m['mountPath'].rstrip('/')}/{item['path']}" == path]
            assert found == [("kvfabric-tenants", "tenants.yaml", True)], f"{group}/{c['name']}: {found}"
    assert "kubectl create secret generic kvfabric-tenants --from-file=tenants.yaml=" in rayservice_path.read_text()


def test_the_model_folder_is_on_every_pod(serve_config, rayservice):
    # Engines load the weights, the router (any node) the tokenizer, the builder the config.
    app, kind = _app(serve_config)
    if kind.engine != "vllm":
        pytest.skip("the reference model is built in")
    path = app["args"]["model_dir"]
    for group, spec in _pod_specs(rayservice):
        for c in spec["containers"]:
            found = [(v["persistentVolumeClaim"]["claimName"], m.get("readOnly"))
                     for v, m in _volumes_at(spec, c, path + "/") if "persistentVolumeClaim" in v]
            assert found == [("kvfabric-models", True)], f"{group}/{c['name']}: {found}"


def test_runtime_env_installs_the_project_dependencies(serve_config, pyproject):
    app, kind = _app(serve_config)
    deps = _deps(pyproject, kind.extras)
    env = app["runtime_env"]
    # The code comes as a zip of the repository at a URL the user sets.
    assert re.fullmatch(r"(https|s3|gs)://\S+\.zip", env["working_dir"]), env["working_dir"]
    pip = {canonicalize_name(r.name): r for r in map(Requirement, env["pip"])}
    # Every runtime dependency but Ray, which the image provides (and must not be reinstalled).
    assert set(pip) == set(deps) - {"ray"}
    for name, req in pip.items():
        assert req.specifier == deps[name].specifier, f"{name}: {req} vs pyproject {deps[name]}"


def test_images_match_the_pinned_ray_and_python(rayservice, pyproject):
    base = f"rayproject/ray:{_ray_version(pyproject)}-{_py_tag(pyproject)}"
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
            assert token and "value" not in token, f"{where}: the token comes from a Secret, never inline"
            ref = token["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == (secret, "auth_token"), where


def test_serve_service_exposes_port_8000(rayservice):
    ports = rayservice["spec"]["serveService"]["spec"]["ports"]
    assert any(p["port"] == 8000 and p.get("targetPort", 8000) == 8000 for p in ports)
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "serve", "containerPort": 8000} in head["ports"]


# ------------------------------------------------------------------ cluster launcher

def test_cluster_config_passes_the_launchers_validation(cluster):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cluster)))   # what `ray up` does first


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
    base = f"rayproject/ray:{_ray_version(pyproject)}-{_py_tag(pyproject)}"
    assert cluster["docker"]["head_image"] in (base, f"{base}-gpu")
    assert cluster["docker"]["worker_image"] == f"{base}-gpu"


def test_cluster_installs_the_project_from_its_file_mount(cluster):
    mounts = cluster["file_mounts"]
    (remote,) = [r for r, local in mounts.items() if (ROOT / local).resolve() == ROOT]
    setup = " && ".join(cluster["setup_commands"])
    # With vLLM's CUDA build: the extra pyproject.toml declares for GPU nodes.
    assert re.search(rf"cd {re.escape(remote)} && pip install -e '\.\[vllm-cuda\]'", setup), setup


def test_cluster_vllm_app_args_fit_its_nodes_and_model(cluster, pyproject):
    from kvfabric.deploy.cli.main import read_app_args
    from kvfabric.deploy.vllm.serve_llm import LLMAppArgs

    assert "vllm-cuda" in pyproject["project"]["optional-dependencies"]
    (repo,) = [r for r, local in cluster["file_mounts"].items() if (ROOT / local).resolve() == ROOT]
    ups = re.findall(r"kvfabric up --engine vllm --args @(\S+)", CLUSTER.read_text())
    assert ups, "cluster.yaml tells the user how to start the vLLM app"
    for remote in ups:
        assert remote.startswith(repo + "/"), f"{remote} is not in the synced repository {repo}"
        args = LLMAppArgs.from_dict(read_app_args("@" + str(ROOT / remote[len(repo) + 1:])))
        # The model folder the engines load is the one every node downloads in setup, in the
        # container's home (rayproject images run as `ray`).
        (folder,) = re.findall(r"--local-dir (\S+)", " ".join(cluster["setup_commands"]))
        assert args.model_dir == folder.replace("~", "/home/ray", 1)
        gpu = [t for t in cluster["available_node_types"].values() if t.get("resources", {}).get("GPU")]
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
    assert "--tenants" in _cli_parsers(_resolve("kvfabric.deploy.cli.main:main"))["up"]._option_string_actions


def test_cluster_start_commands_keep_token_auth(cluster):
    mounted = {_with_home(r) for r in cluster["file_mounts"]}
    for key, flag in (("head_start_ray_commands", "--head"), ("worker_start_ray_commands", "--address=")):
        (start,) = [c for c in cluster[key] if "ray start" in c]
        assert flag in start, key
        assert re.search(r"\bRAY_AUTH_MODE=token\b", start), key
        m = re.search(r"\bRAY_AUTH_TOKEN_PATH=(\S+?);", start)
        assert m and _with_home(m.group(1)) in mounted, f"{key}: the token file is not a file mount"
    head = next(c for c in cluster["head_start_ray_commands"] if "ray start" in c)
    assert "--dashboard-host=0.0.0.0" in head


# ------------------------------------------------------------------ the kvfabric command

def _cli_parsers(main) -> dict[str, argparse.ArgumentParser]:
    """The subcommands `main`'s parser accepts and their parsers, read from the parser it builds."""
    class Built(Exception):
        """Raised from parse_args to stop `main` once its parser is built."""

    seen: list[argparse.ArgumentParser] = []

    def capture(self, *args, **kwargs):
        seen.append(self)
        raise Built

    mp = pytest.MonkeyPatch()
    mp.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    try:
        with pytest.raises(Built):
            main(["__probe__"])
    finally:
        mp.undo()
    (sub,) = [a for a in seen[0]._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_kvfabric_commands_in_manifests_exist(pyproject):
    used = set()
    for path in (*RAYSERVICES.values(), CLUSTER):
        used |= set(re.findall(r"(?<![\w./-])kvfabric[ \t]+([a-z][\w-]*)", path.read_text()))
    assert "up" in used, "cluster.yaml tells the user to run `kvfabric up`"
    target = pyproject["project"]["scripts"]["kvfabric"]
    assert target == "kvfabric.deploy.cli.main:main"
    main = _resolve(target)
    assert callable(main)
    missing = used - set(_cli_parsers(main))
    assert not missing, f"`kvfabric` has no subcommand(s) {sorted(missing)}"
