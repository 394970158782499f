"""The Serve application: an OpenAI-compatible ingress in front of one model
server per node, routed by the fabric's global index.

`app_builder(args)` is the entry point for Serve configs (`import_path:
kvfabric.deploy.serve.app:app_builder`, as the KubeRay manifest uses): it validates the
args, brings the fabric up on the cluster if it is not running (or checks a
running one serves the same model layout), and returns the bound app.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TypeVar

import ray
from kvfabric.actors import NodeConfig
from kvfabric.actors.fabric import FabricMismatch, ensure
from kvfabric.deploy.chaos.faults import NodeChaos
from kvfabric.deploy.reference.model import ModelConfig
from kvfabric.fabric import PoolCapacity, PoolName, TierConfig, WritePolicy
from kvfabric.fabric.index.routes import MAX_SHARDS
from ray import serve
from ray.serve.config import RequestRouterConfig

from .openai_api import OpenAIIngress
from .router import FabricRequestRouter
from .serving import ModelServer
from .tenants import TenantTable, load_tenants

HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node


class AppArgsError(ValueError):
    """App args that do not make a valid app (unknown names, bad values)."""


T = TypeVar("T")


def args_of(cls: type[T], args: dict | None) -> T:
    """App args of dataclass `cls` from a mapping (None: the defaults); a name `cls`
    lacks is an error, not ignored."""
    if args is None:
        return cls()
    if not isinstance(args, dict):
        raise AppArgsError(f"app args must be a mapping, got {type(args).__name__}")
    unknown = set(args) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise AppArgsError(f"unknown app args: {sorted(map(str, unknown))}")
    return cls(**args)


@dataclass(frozen=True)
class AppArgs:
    model_name: str = "kvfabric-tiny"
    shards: int = 4  # index shard actors
    # An absolute path, on every node, to the tenant table (API key -> namespaces; see
    # deploy/serve/tenants.py). None: no keys, every caller is one tenant that may use any
    # namespace.
    tenants_file: str | None = None
    nodes: int = 0  # model-server replicas; 0: one per alive Ray node
    device_pages: int = 2048  # per node and pool; SWA pools get a quarter
    host_pages: int = 8192
    max_positions: int = 4096
    max_tokens_limit: int = 256
    chaos: bool = False  # nodes run with chaos hooks, to inject faults into (`kvfabric chaos`)
    gpus_per_replica: float = 0.0  # GPUs each model server asks Ray for (0: it runs on CPU)

    def __post_init__(self) -> None:
        g = self.gpus_per_replica
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g <= 8:
            raise AppArgsError(f"gpus_per_replica must be a number in [0, 8], got {g!r}")
        if not isinstance(self.chaos, bool):
            raise AppArgsError(f"chaos must be a bool, got {self.chaos!r}")
        if not isinstance(self.model_name, str) or not self.model_name:
            raise AppArgsError(f"model_name must be a non-empty string, got {self.model_name!r}")
        t = self.tenants_file
        if t is not None and (not isinstance(t, str) or not os.path.isabs(t)):
            raise AppArgsError(f"tenants_file must be an absolute path when set, got {t!r}")
        for f in (
            "shards",
            "nodes",
            "device_pages",
            "host_pages",
            "max_positions",
            "max_tokens_limit",
        ):
            v = getattr(self, f)
            low = 0 if f in ("nodes", "host_pages") else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise AppArgsError(f"{f} must be an int >= {low}, got {v!r}")
        if self.device_pages * self.model_config.page_size < self.max_positions:
            # Then every prompt the model takes fits the pools: "too long for the pools"
            # is "too long for the model", a 400 at the ingress.
            raise AppArgsError(
                f"device_pages ({self.device_pages}) of {self.model_config.page_size} tokens "
                f"cannot hold a prompt of max_positions ({self.max_positions}) tokens"
            )
        if self.shards > MAX_SHARDS:
            raise AppArgsError(f"shards must be at most {MAX_SHARDS}, got {self.shards}")

    @classmethod
    def from_dict(cls, args: dict | None) -> "AppArgs":
        if isinstance(args, dict) and "api_key" in args:
            raise AppArgsError(
                "api_key was replaced by tenants_file: a file of API keys and the "
                "namespaces each may use (see deploy/serve/tenants.py)"
            )
        return args_of(cls, args)

    def tenants(self) -> TenantTable | None:
        """The tenant table, read from `tenants_file` (raises TenantsError if it is bad)."""
        return load_tenants(self.tenants_file) if self.tenants_file is not None else None

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(max_positions=self.max_positions)

    def node_config(self) -> NodeConfig:
        layout = self.model_config.layout()
        caps = {PoolName.FULL: PoolCapacity(self.device_pages, self.host_pages)}
        if PoolName.SWA in layout.pools:
            caps[PoolName.SWA] = PoolCapacity(max(1, self.device_pages // 4), self.host_pages // 4)
        return NodeConfig(
            layout,
            caps,
            tier=TierConfig(policy=WritePolicy.WRITE_BACK),
            hooks=NodeChaos if self.chaos else None,
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
    ).bind(args.model_config)
    # The ingress sits beside the HTTP proxy on the head node: a worker node that goes
    # away then costs its model server's requests a retry (HandleBackend), never the
    # ingress replica and every request it was holding.
    ingress = OpenAIIngress.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": 0.25, "resources": {HEAD_RESOURCE: 0.001}}
    )
    return ingress.bind(
        server, args.model_name, args.model_config, args.tenants_file, args.max_tokens_limit
    )


def app_builder(args: dict) -> serve.Application:
    """Serve's application builder: validated args -> fabric up -> the app."""
    parsed = AppArgs.from_dict(args)
    ensure_fabric(parsed)
    return build_app(parsed)
