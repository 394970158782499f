"""LLMAppArgs: what `kvfabric up --engine vllm --args` and a Serve config's `args` say
about the vLLM app, checked where they come in. Its own module, importing neither vLLM
nor Ray Serve LLM, so a bad argument is refused at once (serve_llm.py builds the app)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from kvfabric.deploy.serving.args import AbsolutePathOrEmpty, Args
from kvfabric.deploy.serving.injectors import registered
from pydantic import Field, model_validator

from .model import ensure_tiny_model

# What an LLMConfig says about the engines (the rest are the fabric's settings).
ENGINE_FIELDS = (
    "model_dir",
    "model_id",
    "replicas",
    "tensor_parallel_size",
    "dtype",
    "block_size",
    "max_model_len",
    "kv_cache_bytes",
    "cpus_per_replica",
    "gpus_per_replica",
    "gpu_memory_utilization",
)


class LLMAppArgs(Args):
    # A local HF model folder; "": the small full+SWA model, written at first use.
    model_dir: AbsolutePathOrEmpty = ""
    model_id: Annotated[str, Field(min_length=1)] = "kvfabric-tiny-vllm"
    replicas: Annotated[int, Field(ge=0)] = 0  # engines; 0: one per alive Ray node
    # Each engine's ranks (pages hold every head whatever it is).
    tensor_parallel_size: Annotated[int, Field(ge=1)] = 1
    # The engines' dtype: "" takes the bundled model's (float32), else vLLM's choice ("auto").
    dtype: Literal["", "auto", "float32", "float16", "bfloat16"] = ""
    # vLLM's KV block: one fabric page (a multiple of 32 on CPU, 16 on GPU).
    block_size: Annotated[int, Field(ge=16)] = 32
    max_model_len: Annotated[int, Field(ge=64)] = 2048
    kv_cache_bytes: Annotated[int, Field(ge=1 << 20)] = 12 << 20  # each engine's own KV cache
    device_pages: Annotated[int, Field(ge=1)] = 64  # the node actor's pools (SWA: a quarter)
    host_pages: Annotated[int, Field(ge=0)] = 4096
    # Each node's disk tier (pages of the full-attention pool; SWA: a quarter), in a folder
    # on every node; its pages outlive a restarted node actor (FabricSettings' disk_*).
    disk_pages: Annotated[int, Field(ge=0)] = 0
    disk_folder: AbsolutePathOrEmpty = ""
    disk_write: Literal["write_through", "write_back"] = "write_through"
    shards: Annotated[int, Field(ge=1)] = 2
    remote: bool = True  # engines fetch longer prefixes from other nodes
    index_events: bool = True  # engines feed the index their own caches' contents
    # Ray places engines by it: more than half a node's CPUs, one per node.
    cpus_per_replica: Annotated[float, Field(gt=0, le=64)] = 1.0
    # 0: engines on CPU; else each engine's GPUs (vLLM's CUDA build).
    gpus_per_replica: Annotated[float, Field(ge=0, le=8)] = 0.0
    # GPU engines: the share of a GPU's memory each may take.
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    # API keys -> the cache_salts (namespaces) each may use (deploy/serving/tenants.py); an absolute
    # path on every node, read when the ingress starts. "": any client picks its salt.
    tenants_file: AbsolutePathOrEmpty = ""
    # Chaos runs (`kvfabric chaos --engine vllm`): the nodes take NodeChaos actions, and
    # every engine's connector fails or kills its process at the steps this file names
    # (StepFaultFile; a path on each engine's host). Empty: off.
    chaos_file: AbsolutePathOrEmpty = ""
    # The user's own engines: Ray's LLMConfig as a mapping (its YAML, `kvfabric up
    # --config`), served with the fabric (serve_llm.with_fabric). The engine fields above
    # then stay unset: the LLMConfig says them.
    llm_config: dict | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.llm_config is not None:
            default = LLMAppArgs.model_fields
            both = [f for f in ENGINE_FIELDS if getattr(self, f) != default[f].default]
            if both:
                raise ValueError(f"with llm_config, set {both} in the LLMConfig instead")
        if self.disk_pages and not self.disk_folder:
            raise ValueError("disk_pages needs disk_folder, an absolute path on every node")
        multiple = 16 if self.gpus_per_replica else 32  # vLLM's CUDA and CPU kernels' blocks
        if self.block_size % multiple:
            raise ValueError(
                f"block_size must be a multiple of {multiple} on {self.device()}, got "
                f"{self.block_size}"
            )
        return self

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
        chaos = {}
        if self.chaos_file:  # chaos runs only: the injectors are the chaos harness's to register
            chaos = registered().connector_settings(self.chaos_file)
        disk = {}
        if self.disk_pages:
            disk = {
                "disk_pages": self.disk_pages,
                "disk_folder": str(self.disk_folder),
                "disk_write": self.disk_write,
            }
        return {
            "device_pages": self.device_pages,
            "host_pages": self.host_pages,
            **disk,
            "shards": self.shards,
            "remote": self.remote,
            **chaos,
        }
