"""The vLLM app's args (LLMAppArgs) as a Serve config or `kvfabric up --args` gives them:
bad values are refused with the field's name, good ones become the LLMConfig Serve
deploys. GPU engines (`gpus_per_replica`) are configured here without a GPU: their
bundle asks Ray for the GPU and the engine runs CUDA graphs. The fabric's layout is not
configured here at all: each engine announces it (kv_identity.py names the device, so
CPU- and GPU-computed pages never mix)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from kvfabric.deploy.serve.app import AppArgsError  # noqa: E402
from kvfabric.deploy.vllm.app_args import LLMAppArgs  # noqa: E402
from kvfabric.deploy.vllm.serve_llm import baseline_llm_config, llm_config  # noqa: E402

FIELDS = {f.name for f in dataclasses.fields(LLMAppArgs)}
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 10),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=150, deadline=None)
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
