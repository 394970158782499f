"""The Serve application: an OpenAI-compatible ingress in front of one model
server per node, routed by the fabric's global index.

`app_builder(args)` is the entry point for Serve configs (`import_path:
kvfabric.deploy.reference.serve.app:app_builder`, as the KubeRay manifest uses): it validates the
args, brings the fabric up on the cluster if it is not running (or checks a
running one serves the same model layout), and returns the bound app.
"""

from __future__ import annotations

from typing import Annotated, Any, Self

import ray
from kvfabric.actors.launch import FabricMismatch, ensure
from kvfabric.actors.node.disk import DiskConfig
from kvfabric.actors.node.node_actor import NodeConfig
from kvfabric.core.cache.layout import PoolName
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.tiers import TierConfig, WritePolicy
from kvfabric.core.index.routes import MAX_SHARDS
from kvfabric.deploy.reference.model import ModelConfig
from kvfabric.deploy.serving.args import AbsolutePath, AppArgsError, Args
from kvfabric.deploy.serving.injectors import registered
from kvfabric.deploy.serving.router import FabricRequestRouter
from kvfabric.deploy.serving.tenants import TenantTable, load_tenants
from pydantic import Field, model_validator
from ray import serve
from ray.serve.config import RequestRouterConfig

from .openai_api import OpenAIIngress
from .server import ModelServer

HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node


class AppArgs(Args):
    model_name: Annotated[str, Field(min_length=1)] = "kvfabric-tiny"
    shards: Annotated[int, Field(ge=1, le=MAX_SHARDS)] = 4  # index shard actors
    # An absolute path, on every node, to the tenant table (API key -> namespaces; see
    # deploy/serving/tenants.py). None: no keys, every caller is one tenant that may use any
    # namespace.
    tenants_file: AbsolutePath | None = None
    nodes: Annotated[int, Field(ge=0)] = 0  # model-server replicas; 0: one per alive Ray node
    device_pages: Annotated[int, Field(ge=1)] = 2048  # per node and pool; SWA pools: a quarter
    host_pages: Annotated[int, Field(ge=0)] = 8192
    max_positions: Annotated[int, Field(ge=1)] = 4096
    max_tokens_limit: Annotated[int, Field(ge=1)] = 256
    chaos: bool = False  # nodes run with chaos hooks, to inject faults into (`kvfabric chaos`)
    # The disk tier: pages per node of the full pool (SWA pools: a quarter), kept in
    # disk_folder/<node name>/ (0: no disk tier); `disk_write`: when a page gets its disk
    # copy (write_back: as the host evicts it; write_through: as it is stored).
    disk_pages: Annotated[int, Field(ge=0)] = 0
    disk_folder: AbsolutePath | None = None
    # Given by its value ("write_back") as JSON gives it: strict mode takes only instances.
    disk_write: Annotated[WritePolicy, Field(strict=False)] = WritePolicy.WRITE_BACK
    # GPUs each model server asks Ray for (0: it runs on CPU)
    gpus_per_replica: Annotated[float, Field(ge=0, le=8)] = 0.0

    @model_validator(mode="after")
    def _pools_hold_a_prompt(self) -> Self:
        if self.device_pages * self.reference_model.page_size < self.max_positions:
            # Then every prompt the model takes fits the pools: "too long for the pools"
            # is "too long for the model", a 400 at the ingress.
            raise ValueError(
                f"device_pages ({self.device_pages}) of {self.reference_model.page_size} tokens "
                f"cannot hold a prompt of max_positions ({self.max_positions}) tokens"
            )
        if self.disk_pages and self.disk_folder is None:
            raise ValueError("disk_pages needs a disk_folder")
        if self.disk_write not in (WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH):
            raise ValueError("disk_write is write_back or write_through")
        return self

    @classmethod
    def from_dict(cls, args: Any) -> Self:
        if isinstance(args, dict) and "api_key" in args:
            raise AppArgsError(
                "api_key was replaced by tenants_file: a file of API keys and the "
                "namespaces each may use (see deploy/serving/tenants.py)"
            )
        return super().from_dict(args)

    def tenants(self) -> TenantTable | None:
        """The tenant table, read from `tenants_file` (raises TenantsError if it is bad)."""
        return load_tenants(self.tenants_file) if self.tenants_file is not None else None

    @property
    def reference_model(self) -> ModelConfig:
        return ModelConfig(max_positions=self.max_positions)

    def node_config(self) -> NodeConfig:
        layout = self.reference_model.layout()
        disk = self.disk_pages
        caps = {PoolName.FULL: PoolCapacity(self.device_pages, self.host_pages, disk)}
        if PoolName.SWA in layout.pools:
            caps[PoolName.SWA] = PoolCapacity(
                max(1, self.device_pages // 4), self.host_pages // 4, disk // 4
            )
        hooks = None
        if self.chaos:  # chaos runs only: the injectors are the chaos harness's to register
            hooks = registered().node_hooks
        return NodeConfig(
            layout,
            caps,
            tier=TierConfig(policy=WritePolicy.WRITE_BACK, disk=self.disk_write),
            hooks=hooks,
            disk=DiskConfig(self.disk_folder) if disk and self.disk_folder else None,
        )


def ensure_fabric(args: AppArgs, timeout_s: float = 180.0) -> bool:
    """Start the fabric for the reference model unless one runs; returns whether it
    started one. A running fabric of another layout is an AppArgsError naming what differs."""
    try:
        return ensure(args.node_config(), shards=args.shards, timeout_s=timeout_s)
    except FabricMismatch as e:
        raise AppArgsError(str(e)) from None


def build_app(args: AppArgs) -> serve.Application:
    """The bound app (the fabric must be up). A bad tenant table fails here, before any
    replica starts; each ingress replica reads the file again on its own node."""
    args.tenants()
    replicas = args.nodes or sum(1 for n in ray.nodes() if n["Alive"])
    # The field is Union[str, Callable]: mypy reads the __init__ of Ray's pydantic shim instead.
    router = RequestRouterConfig(
        request_router_class=FabricRequestRouter,  # type: ignore[arg-type]
        request_router_kwargs={},
    )
    # @serve.deployment made these Deployments: mypy sees the classes.
    server = ModelServer.options(  # type: ignore[attr-defined]
        num_replicas=replicas,
        max_replicas_per_node=1,
        request_router_config=router,
        ray_actor_options={"num_cpus": 0.25, "num_gpus": args.gpus_per_replica},
    ).bind(args.reference_model)
    # The ingress sits beside the HTTP proxy on the head node: a worker node that goes
    # away then costs its model server's requests a retry (HandleBackend), never the
    # ingress replica and every request it was holding.
    ingress = OpenAIIngress.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": 0.25, "resources": {HEAD_RESOURCE: 0.001}}
    )
    return ingress.bind(
        server, args.model_name, args.reference_model, args.tenants_file, args.max_tokens_limit
    )


def app_builder(args: dict) -> serve.Application:
    """Serve's application builder: validated args -> fabric up -> the app."""
    parsed = AppArgs.from_dict(args)
    ensure_fabric(parsed)
    return build_app(parsed)
