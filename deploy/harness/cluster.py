"""Where the fabric runs: an embedded local cluster of simulated nodes, or an
existing cluster; and `up` / `down` of the fabric plus its Serve app there.

Token authentication (on by default in Ray 2.60) stays on: an embedded
cluster gets a fresh random token for this process only; against an existing
cluster the caller's `RAY_AUTH_TOKEN` (or Ray's token file) is used as is.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

APP_NAME = "kvfabric"


def keep_auth_on() -> None:
    """Token auth for a cluster this process starts; call before Ray is imported."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] == "token":
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextlib.contextmanager
def local_cluster(
    nodes: int = 3,
    cpus_per_node: int = 2,
    object_store_bytes: int = 256 * 1024**2,
    gpus_per_node: int = 0,
) -> Iterator["Cluster"]:
    """A head and `nodes - 1` workers on this machine, connected; yields the
    `ray.cluster_utils.Cluster` (nodes can be removed and added), shuts down after.
    `gpus_per_node`: GPUs each node announces; they are this machine's, so nodes share them."""
    import ray
    from ray.cluster_utils import Cluster

    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    node_args = {
        "num_cpus": cpus_per_node,
        "num_gpus": gpus_per_node,
        "object_store_memory": object_store_bytes,
    }
    cluster = Cluster(
        initialize_head=True, head_node_args={**node_args, "include_dashboard": False}
    )
    try:
        for _ in range(nodes - 1):
            cluster.add_node(wait=True, **node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def connect(address: str) -> None:
    """Join the cluster at `address`. "auto" (Ray's pick: the cluster started last on this
    machine) is refused when several run here: the command would act on one silently."""
    import ray

    if address == "auto":
        sessions = local_sessions()
        if len(sessions) > 1:
            raise SystemExit(
                f"kvfabric: {len(sessions)} Ray clusters run on this machine "
                f"({', '.join(sessions)}): say which with --address HOST:PORT or RAY_ADDRESS"
            )
    ray.init(address=address, log_to_driver=False)
    print(
        f"connected to the Ray cluster at {ray.get_runtime_context().gcs_address}", file=sys.stderr
    )


def local_sessions(proc: Path = Path("/proc")) -> list[str]:
    """The session folders of the Ray clusters whose GCS runs on this machine (one GCS
    process a cluster), read from the processes' command lines."""
    found = set()
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # gone, or not ours to read
        if not args or not args[0].endswith(b"/gcs_server"):
            continue
        for arg in args:
            if arg.startswith(b"--stdout_filepath="):
                log = Path(arg.split(b"=", 1)[1].decode(errors="replace"))
                found.add(log.parent.parent.name)  # <session>/logs/gcs_server.out
    return sorted(found)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


ENGINES = ("reference", "vllm")


def up(
    args: dict | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    wait_s: float = 300.0,
    engine: str = "reference",
) -> Endpoint:
    """Deploy the fabric and the Serve app onto the connected cluster and leave them
    running. Binds to localhost unless `host` says otherwise. `engine`: "reference"
    (the bit-exact reference model, deploy/reference/serve/app.py) or "vllm" (vLLM under
    Ray Serve LLM, deploy/vllm/serve/serve_llm.py; its args are LLMAppArgs)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "vllm":
        from kvfabric.deploy.vllm.serve.serve_llm import llm_app_builder as builder

        ready = "/v1/models"
    else:
        from kvfabric.deploy.reference.serve.app import app_builder as builder

        ready = "/healthz"
    return serve_app(builder(args or {}), ready, host, port, wait_s)


def serve_app(
    app, ready: str, host: str = "127.0.0.1", port: int = 8000, wait_s: float = 300.0
) -> Endpoint:
    """Run a bound Serve app as APP_NAME at `/` on the connected cluster; its endpoint once
    Serve says it runs (serve.run waits on Serve's status) and `ready` (a path) answers
    through the proxy. An app Serve could not deploy raises DeployFailed (`deploy`)."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    deadline = time.monotonic() + wait_s
    deploy(app, APP_NAME, "/", wait_s)
    endpoint = Endpoint("127.0.0.1" if host in ("0.0.0.0", "::") else host, port)
    wait_healthy(endpoint, max(deadline - time.monotonic(), 1.0), ready)
    return endpoint


class DeployFailed(RuntimeError):
    """Serve could not deploy the app (its message says why)."""


def deploy(app, name: str, route_prefix: str, wait_s: float = 300.0) -> None:
    """Deploy `app` and wait until Serve says it runs, at most `wait_s` seconds. One Serve
    could not deploy, or one still not running then, raises DeployFailed naming each
    unhealthy deployment's state and Serve's words for it. (serve.run waits without
    a bound: a replica no node can place kept `kvfabric demo` waiting for 13 minutes.)"""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + wait_s
    try:
        # serve.run is this call with _blocking=True, which waits for as long as it takes.
        serve._run(app, _blocking=False, name=name, route_prefix=route_prefix)
    except RuntimeError as e:
        raise DeployFailed(f"{e}\n{failed_deployments(name)}".rstrip()) from None
    while True:
        status = serve.status().applications.get(name)
        state = status.status if status is not None else ApplicationStatus.NOT_STARTED
        if state == ApplicationStatus.RUNNING:
            return
        if state == ApplicationStatus.DEPLOY_FAILED or time.monotonic() > deadline:
            why = (
                "failed to deploy"
                if state == ApplicationStatus.DEPLOY_FAILED
                else (f"not running after {wait_s:.0f} s ({state.value})")
            )
            message = status.message.strip() if status is not None else ""
            raise DeployFailed(
                f"application {name!r} {why}: {message}\n{failed_deployments(name)}".rstrip()
            )
        time.sleep(0.2)  # Serve's status is polled: it has no wait with a bound


def failed_deployments(app: str) -> str:
    """What Serve's status API says of each unhealthy deployment of `app`, a line each."""
    from ray import serve
    from ray.serve.schema import DeploymentStatus

    status = serve.status().applications.get(app)
    if status is None:
        return ""
    return "\n".join(
        f"{name}: {d.status.value}: {d.message.strip()}"
        for name, d in sorted(status.deployments.items())
        if d.status != DeploymentStatus.HEALTHY
    )


def wait_healthy(endpoint: Endpoint, wait_s: float, path: str = "/healthz") -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(endpoint.base_url + path, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass  # not serving yet: try again until the deadline
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the app at {endpoint.base_url} did not become healthy in {wait_s:.0f} s"
            )
        time.sleep(0.5)


def down(timeout_s: float = 30.0) -> list[str]:
    """Delete the Serve app and kill every fabric's actors on the connected cluster (the
    default one's and each KV identity's, actors/names.py); returns the actors killed."""
    import ray
    from kvfabric.actors.directory import DIRECTORY, NAMESPACE
    from kvfabric.actors.served import forget_all
    from ray import serve
    from ray.exceptions import RayError
    from ray.serve.exceptions import RayServeException

    with contextlib.suppress(RayError, RuntimeError, RayServeException):
        serve.delete(APP_NAME)
    fabrics: dict[str, list[str]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        ns = actor["namespace"]
        if ns == NAMESPACE or ns.startswith(NAMESPACE + "."):
            fabrics.setdefault(ns, []).append(actor["name"])
    killed = []
    for ns, names in sorted(fabrics.items()):
        with contextlib.suppress(ValueError, RayError):  # its watcher adds no node meanwhile
            directory = ray.get_actor(DIRECTORY, namespace=ns)
            ray.get(directory.stop_watching.remote(), timeout=timeout_s)
        for name in sorted(names):
            with contextlib.suppress(ValueError, RayError):
                ray.kill(ray.get_actor(name, namespace=ns))
                killed.append(name)
    forget_all()  # no fabric serves any model now
    return killed
