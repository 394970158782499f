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
from typing import Any

import ray
from kvfabric.actors.directory import node_actor_name
from kvfabric.deploy.serve.tenants import load_tenants
from ray import serve
from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.serve.llm import LLMConfig, build_openai_app

from .app_args import LLMAppArgs
from .connector import kv_transfer_config
from .llm_ingress import FabricLLMIngress
from .llm_router import FabricLLMRouter

INGRESS_CPUS = 0.25


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
