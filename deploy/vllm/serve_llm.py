"""The fabric under Ray Serve LLM: `build_openai_app` with vLLM engines whose KV layer
is the FabricConnector, replicas ranked by FabricLLMRouter, the index fed by each
engine's KV events.

`llm_app_builder(args)` is the entry point for Serve configs (`import_path:
kvfabric.deploy.vllm.serve_llm:llm_app_builder`, as `kvfabric up --engine vllm` and the
manifests use): it validates the args and returns the bound app. The engines start the
fabric of their KV identity themselves (its layout is the one they announce), with the
node pools the args give; the router finds it by the served model's name.

Serve places the replicas; an LLMConfig is written before that. So a callback
(`FabricNodeCallback`) runs in each replica before its engine starts and points the
engine at its own node's actor, and gives it a KV-event socket of its own.
"""

from __future__ import annotations

import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from kvfabric.actors.directory import node_actor_name
from kvfabric.deploy.chaos.faults import HOOKS as NODE_CHAOS
from kvfabric.deploy.chaos.faults import StepFaultFile
from kvfabric.deploy.serve.app import AppArgsError, args_of
from kvfabric.deploy.serve.tenants import load_tenants
from ray import serve
from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.serve.llm import LLMConfig, build_openai_app

from .connector import kv_transfer_config
from .llm_ingress import FabricLLMIngress
from .llm_router import FabricLLMRouter
from .model import ensure_tiny_model

INGRESS_CPUS = 0.25
DTYPES = ("", "auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class LLMAppArgs:
    model_dir: str = (
        ""  # a local HF model folder; "": the small full+SWA model, written at first use
    )
    model_id: str = "kvfabric-tiny-vllm"
    replicas: int = 0  # engines; 0: one per alive Ray node
    tensor_parallel_size: int = 1  # each engine's ranks (pages hold every head whatever it is)
    # The engines' dtype: "" takes the bundled model's (float32), else vLLM's choice ("auto").
    dtype: str = ""
    block_size: int = 32  # vLLM's KV block: one fabric page (a multiple of 32 on CPU, 16 on GPU)
    max_model_len: int = 2048
    kv_cache_bytes: int = 12 << 20  # each engine's own (device) KV cache
    device_pages: int = 64  # the node actor's pools, per pool (SWA pools: a quarter)
    host_pages: int = 4096
    shards: int = 2
    remote: bool = True  # engines fetch longer prefixes from other nodes
    index_events: bool = True  # engines feed the index their own caches' contents
    cpus_per_replica: float = (
        1.0  # Ray places engines by it: more than half a node's CPUs, one per node
    )
    gpus_per_replica: float = 0.0  # 0: engines on CPU; else each engine's GPUs (vLLM's CUDA build)
    gpu_memory_utilization: float = 0.9  # GPU engines: the share of a GPU's memory each may take
    # API keys -> the cache_salts (namespaces) each may use (deploy/serve/tenants.py); an absolute
    # path on every node, read when the ingress starts. "": any client picks its salt.
    tenants_file: str = ""
    # Chaos runs (`kvfabric chaos --engine vllm`): the nodes take NodeChaos actions, and
    # every engine's connector fails or kills its process at the steps this file names
    # (StepFaultFile; a path on each engine's host). Empty: off.
    chaos_file: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model_dir, str) or (
            self.model_dir and not Path(self.model_dir).is_absolute()
        ):
            raise AppArgsError(
                f"model_dir must be an absolute path or empty, got {self.model_dir!r}"
            )
        if not isinstance(self.model_id, str) or not self.model_id:
            raise AppArgsError(f"model_id must be a non-empty string, got {self.model_id!r}")
        for f, low in (
            ("replicas", 0),
            ("tensor_parallel_size", 1),
            ("block_size", 16),
            ("max_model_len", 64),
            ("kv_cache_bytes", 1 << 20),
            ("device_pages", 1),
            ("host_pages", 0),
            ("shards", 1),
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise AppArgsError(f"{f} must be an int >= {low}, got {v!r}")
        c, g = self.cpus_per_replica, self.gpus_per_replica
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c <= 64:
            raise AppArgsError(f"cpus_per_replica must be a number in (0, 64], got {c!r}")
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g <= 8:
            raise AppArgsError(f"gpus_per_replica must be a number in [0, 8], got {g!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise AppArgsError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        multiple = 16 if g else 32  # vLLM's CUDA and CPU kernels' block sizes
        if self.block_size % multiple:
            raise AppArgsError(
                f"block_size must be a multiple of {multiple} on {self.device()}, got "
                f"{self.block_size}"
            )
        if self.dtype not in DTYPES:
            raise AppArgsError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for f in ("remote", "index_events"):
            if not isinstance(getattr(self, f), bool):
                raise AppArgsError(f"{f} must be a bool, got {getattr(self, f)!r}")
        for f in ("tenants_file", "chaos_file"):
            v = getattr(self, f)
            if not isinstance(v, str) or (v and not Path(v).is_absolute()):
                raise AppArgsError(f"{f} must be an absolute path or empty, got {v!r}")

    @classmethod
    def from_dict(cls, args: dict | None) -> "LLMAppArgs":
        return args_of(cls, args)

    def model(self) -> str:
        return self.model_dir or str(ensure_tiny_model())

    def device(self) -> str:
        """Where the engines compute (the node actors' pools stay in host memory)."""
        return "cuda" if self.gpus_per_replica else "cpu"

    def engine_dtype(self) -> str:
        return self.dtype or ("auto" if self.model_dir else "float32")

    def bundle(self) -> dict[str, float]:
        """One engine's placement group bundle."""
        gpus = {"GPU": self.gpus_per_replica} if self.gpus_per_replica else {}
        return {"CPU": self.cpus_per_replica, **gpus}

    def fabric_settings(self) -> dict[str, Any]:
        """The connector's settings for the fabric its engine starts (FabricSettings):
        each node's pools (SWA pools: a quarter) and index shards."""
        chaos = (
            {"node_hooks": NODE_CHAOS, **StepFaultFile.settings(self.chaos_file)}
            if self.chaos_file
            else {}
        )
        return {
            "device_pages": self.device_pages,
            "host_pages": self.host_pages,
            "shards": self.shards,
            "remote": self.remote,
            **chaos,
        }


class FabricNodeCallback(CallbackBase):
    """Runs in a replica before its engine starts: the engine's connector is pointed at
    this node's actor, and its KV events at a socket of its own, named after the replica
    in the index. The engine kwargs' nested dicts are shared with the engine config Serve
    builds from them, so they are changed in place."""

    async def on_before_node_init(self) -> None:
        ctx = ray.get_runtime_context()
        kwargs = self.llm_config.engine_kwargs
        extra = kwargs["kv_transfer_config"]["kv_connector_extra_config"]
        extra["node_actor"] = node_actor_name(ctx.get_node_id())
        extra["ray_address"] = ctx.gcs_address
        events = kwargs.get("kv_events_config")
        if events:
            endpoint = f"ipc://{tempfile.gettempdir()}/kvf-events-{uuid.uuid4().hex[:12]}"
            events["endpoint"], events["replay_endpoint"] = endpoint, endpoint + "-replay"
            extra["engine_slot"] = serve.get_replica_context().replica_id.unique_id


def llm_config(args: LLMAppArgs) -> LLMConfig:
    """Engines with the FabricConnector and KV events, ranked by FabricLLMRouter."""
    engine = {"kv_transfer_config": kv_transfer_config("", "", **args.fabric_settings())}
    # The node actor and the Ray address are filled in on the replica's node.
    if args.index_events:
        engine["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq"}
    router = {
        "request_router_class": FabricLLMRouter,
        "request_router_kwargs": {"model_dir": args.model(), "model_id": args.model_id},
    }
    return _config(args, engine, router, callback_config={"callback_class": FabricNodeCallback})


def baseline_llm_config(args: LLMAppArgs) -> LLMConfig:
    """What users run without the fabric: the same engines with vLLM's own prefix cache
    only, ranked by Ray Serve LLM's PrefixCacheAffinityRouter (its defaults)."""
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter

    return _config(args, {}, {"request_router_class": PrefixCacheAffinityRouter})


def _config(args: LLMAppArgs, engine: dict, router: dict, **extra) -> LLMConfig:
    replicas = args.replicas or sum(1 for n in ray.nodes() if n["Alive"])
    # The engine computes in the dtype the nodes store (the model config's); CUDA graphs
    # only on a GPU (the CPU backend runs eager).
    engine = {
        "enforce_eager": not args.gpus_per_replica,
        "dtype": args.engine_dtype(),
        "tensor_parallel_size": args.tensor_parallel_size,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "kv_cache_memory_bytes": args.kv_cache_bytes,
        "enable_prefix_caching": True,
        # Answers say how many prompt tokens came from a cache (usage.prompt_tokens_details).
        "enable_prompt_tokens_details": True,
        **engine,
    }
    if args.gpus_per_replica:
        engine["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.tensor_parallel_size > 1 and not args.gpus_per_replica:
        # vLLM's CPU workers each bind their OpenMP threads to the cores listed: one a rank.
        binds = "|".join(str(i) for i in range(args.tensor_parallel_size))
        extra.setdefault("runtime_env", {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": binds}})
    return LLMConfig(
        model_loading_config={"model_id": args.model_id, "model_source": args.model()},
        engine_kwargs=engine,
        # The replica's own CPU is counted in its engine's bundle (Serve LLM adds
        # the two): `cpus_per_replica` is what one engine takes of a node.
        deployment_config={
            "num_replicas": replicas,
            "ray_actor_options": {"num_cpus": 0},
            "request_router_config": router,
        },
        placement_group_config={"bundles": [args.bundle()]},
        **extra,
    )


def build_llm_app(args: LLMAppArgs) -> serve.Application:
    """The fabric's app: its engines (which start the fabric of their KV identity), and
    the OpenAI ingress with the tenant table when there is one."""
    ingress = {
        "ingress_cls": FabricLLMIngress,
        "ingress_extra_kwargs": {"tenants_file": args.tenants_file},
    }
    return _app(llm_config(args), ingress_cls_config=ingress)


def build_baseline_app(args: LLMAppArgs) -> serve.Application:
    """The stock app of the same engines: Ray's ingress, `baseline_llm_config`."""
    return _app(baseline_llm_config(args))


def _app(config: LLMConfig, **builder: Any) -> serve.Application:
    # The ingress only parses and forwards HTTP (Serve LLM asks a whole CPU by default).
    return build_openai_app(
        {
            "llm_configs": [config],
            **builder,
            "ingress_deployment_config": {"ray_actor_options": {"num_cpus": INGRESS_CPUS}},
        }
    )


def llm_app_builder(args: dict) -> serve.Application:
    """Serve's application builder: validated args -> the app."""
    parsed = LLMAppArgs.from_dict(args)
    if parsed.tenants_file:
        load_tenants(parsed.tenants_file)  # a bad table fails the deploy, not each replica
    return build_llm_app(parsed)
