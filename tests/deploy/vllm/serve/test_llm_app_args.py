"""The vLLM app's args (LLMAppArgs) as a Serve config or `kvfabric up --args` gives them:
bad values are refused with the field's name, good ones become the LLMConfig Serve
deploys. GPU engines (`gpus_per_replica`) are configured here without a GPU: their
bundle asks Ray for the GPU and the engine runs CUDA graphs. The fabric's layout is not
configured here at all: each engine announces it (kv_identity.py names the device, so
CPU- and GPU-computed pages never mix)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples

pytest.importorskip("vllm")

from kvfabric.deploy.reference.serve.app import AppArgsError  # noqa: E402
from kvfabric.deploy.vllm.serve.app_args import LLMAppArgs  # noqa: E402
from kvfabric.deploy.vllm.serve.llm_router import FabricLLMRouter  # noqa: E402
from kvfabric.deploy.vllm.serve.serve_llm import (  # noqa: E402
    FabricError,
    FabricLLMServer,
    baseline_llm_config,
    llm_app_builder,
    llm_config,
    with_fabric,
)
from ray.serve.llm import LLMConfig  # noqa: E402
from ray.serve.llm.deployment import LLMServer  # noqa: E402

FIELDS = set(LLMAppArgs.model_fields)
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 10),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=examples(150), deadline=None)
@given(field=st.sampled_from(sorted(FIELDS)), value=JUNK)
def test_a_bad_value_is_refused_naming_its_field(field, value):
    try:
        args = LLMAppArgs.from_dict({field: value})
    except AppArgsError as e:
        assert field in str(e)
        return
    # Accepted: the value has the field's type and range, and the args still configure an app.
    assert getattr(args, field) == value
    assert args.bundle()["CPU"] > 0


def test_unknown_args_are_refused():
    with pytest.raises(AppArgsError, match="gpus"):
        LLMAppArgs.from_dict({"gpus": 1})
    with pytest.raises(AppArgsError, match="mapping"):
        LLMAppArgs.from_dict(["replicas", 2])


def test_block_sizes_follow_the_engines_device():
    with pytest.raises(AppArgsError, match="multiple of 32 on cpu"):
        LLMAppArgs(block_size=48)
    assert LLMAppArgs(block_size=48, gpus_per_replica=1).block_size == 48
    with pytest.raises(AppArgsError, match="multiple of 16 on cuda"):
        LLMAppArgs(block_size=40, gpus_per_replica=1)


def test_cpu_engines_config():
    args = LLMAppArgs(replicas=2, cpus_per_replica=2.0, tensor_parallel_size=2)
    cfg = llm_config(args)
    assert cfg.placement_group_config == {"bundles": [{"CPU": 2.0}]}
    assert cfg.engine_kwargs["enforce_eager"] is True
    assert cfg.engine_kwargs["tensor_parallel_size"] == 2
    assert "gpu_memory_utilization" not in cfg.engine_kwargs
    assert cfg.engine_kwargs["dtype"] == "float32"  # the bundled model's
    assert LLMAppArgs(model_dir="/models/m").engine_dtype() == "auto"
    transfer = cfg.engine_kwargs["kv_transfer_config"]
    assert transfer["kv_connector"] == "FabricConnector"
    # The node pools of the fabric the engines start travel in the connector's settings.
    extra = transfer["kv_connector_extra_config"]
    assert (extra["device_pages"], extra["host_pages"], extra["shards"]) == (64, 4096, 2)
    router = cfg.deployment_config["request_router_config"]["request_router_kwargs"]
    assert router == {"model_dir": args.model(), "model_id": args.model_id}


def test_gpu_engines_config():
    args = LLMAppArgs(replicas=3, cpus_per_replica=4.0, gpus_per_replica=1.0, block_size=16)
    cfg = llm_config(args)
    assert cfg.placement_group_config == {"bundles": [{"CPU": 4.0, "GPU": 1.0}]}
    assert cfg.engine_kwargs["enforce_eager"] is False
    assert cfg.engine_kwargs["block_size"] == 16
    assert cfg.engine_kwargs["gpu_memory_utilization"] == 0.9
    # The stock app on the same GPU engines, for the comparison users would make.
    assert baseline_llm_config(args).placement_group_config == cfg.placement_group_config


# --- the user's own LLMConfig -----------------------------------------------------------------


def plain_config(**over) -> LLMConfig:
    """An LLMConfig as a user writes it for Ray Serve LLM, with nothing of the fabric."""
    fields = {
        "model_loading_config": {"model_id": "my-llama", "model_source": "org/llama-3-8b"},
        "engine_kwargs": {
            "tensor_parallel_size": 2,
            "max_model_len": 8192,
            "hf_overrides": {"rope_theta": 5e5},
        },
        "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}},
        "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}},
    }
    for k, v in over.items():
        fields[k] = {**fields.get(k, {}), **v}
    return LLMConfig(**fields)


def test_with_fabric_keeps_the_users_config_and_adds_the_fabric():
    mine = plain_config()
    before = mine.model_dump()
    cfg = with_fabric(mine, host_pages=8192, shards=4)
    assert mine.model_dump() == before  # the user's config is not changed
    engine = cfg.engine_kwargs
    assert engine["tensor_parallel_size"] == 2 and engine["max_model_len"] == 8192
    assert engine["hf_overrides"] == {"rope_theta": 5e5}
    assert cfg.deployment_config["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4}
    assert cfg.runtime_env == mine.runtime_env and cfg.model_id == "my-llama"
    extra = engine["kv_transfer_config"]["kv_connector_extra_config"]
    assert (extra["host_pages"], extra["shards"]) == (8192, 4)
    assert engine["kv_events_config"]["enable_kv_cache_events"] is True
    assert engine["enable_prefix_caching"] is True
    router = cfg.deployment_config["request_router_config"]
    assert router["request_router_class"] is FabricLLMRouter
    # The router tokenizes as the engines do: the hub id (or tokenizer_source) is its source.
    assert router["request_router_kwargs"] == {
        "model_dir": "org/llama-3-8b",
        "model_id": "my-llama",
    }
    assert cfg.server_cls is FabricLLMServer and issubclass(FabricLLMServer, LLMServer)
    tokenizer = plain_config(model_loading_config={"tokenizer_source": "/tok"})
    assert (
        with_fabric(tokenizer).deployment_config["request_router_config"]["request_router_kwargs"][
            "model_dir"
        ]
        == "/tok"
    )
    assert "kv_events_config" not in with_fabric(mine, index_events=False).engine_kwargs


@pytest.mark.parametrize(
    "over, field",
    [
        (
            {"engine_kwargs": {"kv_transfer_config": {"kv_connector": "LMCacheConnectorV1"}}},
            "kv_transfer_config",
        ),
        ({"engine_kwargs": {"kv_events_config": {"publisher": "zmq"}}}, "kv_events_config"),
        ({"engine_kwargs": {"enable_prefix_caching": False}}, "enable_prefix_caching"),
        ({"server_cls": LLMServer}, "server_cls"),
        (
            {
                "deployment_config": {
                    "request_router_config": {"request_router_class": FabricLLMRouter}
                }
            },
            "request_router_config",
        ),
    ],
)
def test_with_fabric_refuses_what_it_would_replace(over, field):
    server = over.pop("server_cls", None)
    mine = plain_config(**over)
    if server is not None:
        mine = mine.model_copy(update={"server_cls": server})
    with pytest.raises(FabricError, match=field):
        with_fabric(mine)


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"host_pages": -1}, "host_pages"),
        ({"shards": "4"}, "shards"),
        ({"no_such_setting": 1}, "no_such_setting"),
        ({"node_actor": "kvf-node-x"}, "node_actor"),
        ({"index_events": "yes"}, "index_events"),
        ({"disk_pages": 64}, "disk_folder"),
        ({"disk_pages": 64, "disk_folder": "relative/dir"}, "disk_folder"),
        ({"disk_pages": 64, "disk_folder": "/d", "disk_write": "sometimes"}, "disk_write"),
        ({"disk_sync": "always"}, "disk_sync"),
        ({"disk_io": "gds"}, "disk_io"),
        ({"swa_disk_pages": 8, "disk_folder": "/d"}, "swa_disk_pages"),
        ({"disk_pages": -1}, "disk_pages"),
    ],
)
def test_with_fabric_refuses_bad_settings(settings, match):
    with pytest.raises(FabricError, match=match):
        with_fabric(plain_config(), **settings)
    with pytest.raises(FabricError, match="LLMConfig"):
        with_fabric({"model_loading_config": {"model_id": "x"}})  # type: ignore[arg-type]


def test_app_args_with_an_llm_config_leave_the_engine_to_it():
    own = plain_config().model_dump(exclude_unset=True)
    args = LLMAppArgs.from_dict({"llm_config": own, "host_pages": 512})
    assert args.llm_config == own
    with pytest.raises(AppArgsError, match="replicas"):
        LLMAppArgs.from_dict({"llm_config": own, "replicas": 2})
    with pytest.raises(AppArgsError, match="not a valid LLMConfig"):
        llm_app_builder({"llm_config": {"model_loading_config": {"model_id": "x"}, "bogus": 1}})


def test_disk_settings_reach_the_node_actors_config(tmp_path):
    """Each fabric (KV identity) keeps its disk pages in its own folder below disk_folder;
    the SWA pool's disk tier defaults to a quarter, and the write policy is passed on."""
    from kvfabric.actors.names import layout_namespace
    from kvfabric.core.cache.layout import KVLayout, PoolName
    from kvfabric.core.cache.tiers import WritePolicy
    from kvfabric.deploy.vllm.connector.jobs import FabricSettings

    layout = KVLayout(layers=("full", "swa"), kv_heads=2, head_dim=16, page_size=16, window=32)
    s = FabricSettings(disk_pages=256, disk_folder=str(tmp_path), disk_write="write_back")
    config = s.node_config(layout)
    assert config.capacities[PoolName.FULL].disk == 256
    assert config.capacities[PoolName.SWA].disk == 64
    assert config.tier.disk is WritePolicy.WRITE_BACK
    assert config.disk is not None
    assert config.disk.folder == str(tmp_path / layout_namespace(layout.fingerprint, "kvfabric"))
    assert FabricSettings().node_config(layout).disk is None
    args = LLMAppArgs.from_dict({"disk_pages": 128, "disk_folder": str(tmp_path)})
    assert FabricSettings.from_extra(args.fabric_settings()).disk_pages == 128
    with pytest.raises(AppArgsError, match="disk_folder"):
        LLMAppArgs.from_dict({"disk_pages": 128})
