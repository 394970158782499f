"""The fabric under Ray Serve LLM: `with_fabric(llm_config)` makes any vLLM `LLMConfig`
one whose engines keep their KV in the fabric (the FabricConnector), whose replicas are
ranked by FabricLLMRouter, and whose engines feed the index their KV events; serve it
with Ray's own `build_openai_app`.

`llm_app_builder(args)` is the entry point for Serve configs (`import_path:
kvfabric.deploy.vllm.serve.serve_llm:llm_app_builder`, as `kvfabric up --engine vllm` and the
manifests use): it validates the args and returns the bound app, from the bundled
model's args or from the user's own LLMConfig (`llm_config`). The engines start the
fabric of their KV identity themselves (its layout is the one they announce), with the
node pools the settings give; the router finds it by the served model's name.

Serve places the replicas after an LLMConfig is written. So the replicas run
`FabricLLMServer` (Ray's public `LLMServer`, named by the config's `server_cls`), which
points its engine at its own node's actor, and gives it a KV-event socket of its own,
before the engine starts.
"""

from __future__ import annotations

import copy
import tempfile
import uuid
from typing import Any

import ray
from kvfabric.actors.directory import node_actor_name
from kvfabric.deploy.serving.args import AppArgsError
from kvfabric.deploy.serving.tenants import load_tenants
from kvfabric.deploy.vllm.connector import kv_transfer_config
from ray import serve
from ray.serve.llm import LLMConfig, build_openai_app
from ray.serve.llm.deployment import LLMServer

from .app_args import LLMAppArgs
from .llm_ingress import FabricLLMIngress
from .llm_router import FabricLLMRouter

INGRESS_CPUS = 0.25
# Filled in on the replica's node (FabricLLMServer), never by a config.
_PER_REPLICA = ("node_actor", "ray_address", "engine_slot")


class FabricError(ValueError):
    """An LLMConfig the fabric cannot serve as given; the message says which field and why."""


class FabricLLMServer(LLMServer):
    """Ray Serve LLM's server whose engine is pointed, before it starts, at this node's
    actor, and its KV events at a socket of its own, named after the replica in the
    index. The replica's copy of the config is changed in place: the engine config Serve
    builds from it shares its nested dicts."""

    # Serve awaits an async constructor, as it does LLMServer's own.
    async def __init__(self, llm_config: LLMConfig, **kwargs: Any) -> None:  # type: ignore[misc]
        ctx = ray.get_runtime_context()
        engine = llm_config.engine_kwargs
        extra = engine["kv_transfer_config"]["kv_connector_extra_config"]
        extra["node_actor"] = node_actor_name(ctx.get_node_id())
        extra["ray_address"] = ctx.gcs_address
        events = engine.get("kv_events_config")
        if events:
            endpoint = f"ipc://{tempfile.gettempdir()}/kvf-events-{uuid.uuid4().hex[:12]}"
            events["endpoint"], events["replay_endpoint"] = endpoint, endpoint + "-replay"
            extra["engine_slot"] = serve.get_replica_context().replica_id.unique_id
        await super().__init__(llm_config, **kwargs)


def with_fabric(llm_config: LLMConfig, *, index_events: bool = True, **settings: Any) -> LLMConfig:
    """A copy of `llm_config` served with the fabric as its engines' KV layer.

    Everything the config says is kept (model, `engine_kwargs`, placement, LoRA, runtime
    env); added are the FabricConnector (`settings`: its FabricSettings, such as
    `device_pages`, `host_pages`, `shards`, `remote`), the engines' KV events feeding the
    index (`index_events`), FabricLLMRouter, and the replica class that points each
    engine at its node. A config that already sets one of those is refused (FabricError
    naming it): the fabric would replace it silently otherwise.
    """
    if not isinstance(llm_config, LLMConfig):
        raise FabricError(f"with_fabric takes a ray.serve.llm.LLMConfig, got {type(llm_config)}")
    if str(llm_config.llm_engine) != "vLLM":
        raise FabricError(f"llm_engine {llm_config.llm_engine!r}: the fabric serves vLLM engines")
    given = sorted(set(settings) & set(_PER_REPLICA))
    if given:
        raise FabricError(f"{given} are set on each replica's node, not in the config")
    if not isinstance(index_events, bool):
        raise FabricError(f"index_events must be a bool, got {index_events!r}")
    engine = copy.deepcopy(llm_config.engine_kwargs)
    for key, why in (
        ("kv_transfer_config", "the fabric is the engines' KV connector and chains no other"),
        ("kv_events_config", "the fabric feeds its index from the engines' KV events"),
    ):
        if engine.get(key) and (key != "kv_events_config" or index_events):
            raise FabricError(f"engine_kwargs.{key} is set: {why}")
    if engine.get("enable_prefix_caching") is False:
        raise FabricError(
            "engine_kwargs.enable_prefix_caching is False: the fabric caches prefixes "
            "through the engine's own prefix cache (its block hashes and KV events)"
        )
    if llm_config.server_cls is not None:
        raise FabricError(
            f"server_cls is set ({llm_config.server_cls!r}): the fabric's replicas run "
            "FabricLLMServer"
        )
    deployment = copy.deepcopy(llm_config.deployment_config)
    if (deployment.get("request_router_config") or {}).get("request_router_class"):
        raise FabricError(
            "deployment_config.request_router_config sets a router: the fabric ranks "
            "replicas by what their nodes hold (FabricLLMRouter)"
        )
    loading: Any = llm_config.model_loading_config  # a ModelLoadingConfig once validated
    source = loading.tokenizer_source or loading.model_source
    if not isinstance(source, str):
        raise FabricError(
            "model_loading_config: a cloud mirror needs tokenizer_source (a local folder "
            "or hub id): the router tokenizes prompts as the engines do"
        )
    try:
        engine["kv_transfer_config"] = kv_transfer_config("", "", **settings)
    except (TypeError, ValueError) as e:
        raise FabricError(f"fabric settings: {e}") from None
    if index_events:
        engine["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq"}
    engine.setdefault("enable_prefix_caching", True)
    # Answers say how many prompt tokens came from a cache (usage.prompt_tokens_details).
    engine.setdefault("enable_prompt_tokens_details", True)
    deployment["request_router_config"] = {
        **(deployment.get("request_router_config") or {}),
        "request_router_class": FabricLLMRouter,
        "request_router_kwargs": {"model_dir": source, "model_id": llm_config.model_id},
    }
    return llm_config.model_copy(
        deep=True,
        update={
            "engine_kwargs": engine,
            "deployment_config": deployment,
            "server_cls": FabricLLMServer,
        },
    )


def llm_config(args: LLMAppArgs) -> LLMConfig:
    """The bundled model's (or `args.model_dir`'s) engines, with the fabric."""
    settings = args.fabric_settings()
    return with_fabric(_config(args, {}), index_events=args.index_events, **settings)


def baseline_llm_config(args: LLMAppArgs) -> LLMConfig:
    """What users run without the fabric: the same engines with vLLM's own prefix cache
    only, ranked by Ray Serve LLM's PrefixCacheAffinityRouter (its defaults)."""
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter

    return _config(args, {"request_router_class": PrefixCacheAffinityRouter})


def _config(args: LLMAppArgs, router: dict, **extra) -> LLMConfig:
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
        "enable_prompt_tokens_details": True,
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
            **({"request_router_config": router} if router else {}),
        },
        placement_group_config={"bundles": [args.bundle()]},
        **extra,
    )


def build_llm_app(args: LLMAppArgs, config: LLMConfig | None = None) -> serve.Application:
    """The fabric's app: its engines (which start the fabric of their KV identity), and
    the OpenAI ingress with the tenant table when there is one. `config`: the engines'
    LLMConfig, with the fabric (default: `llm_config(args)`)."""
    ingress = {
        "ingress_cls": FabricLLMIngress,
        "ingress_extra_kwargs": {"tenants_file": args.tenants_file},
    }
    return _app(config or llm_config(args), ingress_cls_config=ingress)


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
    """Serve's application builder: validated args -> the app. With `llm_config` (Ray's
    LLMConfig, as its YAML gives it), the engines are that config's, with the fabric."""
    parsed = LLMAppArgs.from_dict(args)
    if parsed.tenants_file:
        load_tenants(parsed.tenants_file)  # a bad table fails the deploy, not each replica
    config = None
    if parsed.llm_config is not None:
        try:
            own = LLMConfig.model_validate(parsed.llm_config)
        except ValueError as e:
            raise AppArgsError(f"llm_config is not a valid LLMConfig: {e}") from None
        config = with_fabric(own, index_events=parsed.index_events, **parsed.fabric_settings())
    return build_llm_app(parsed, config)
