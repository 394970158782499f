"""LLMAppArgs: what `kvfabric up --engine vllm --args` and a Serve config's `args` say
about the vLLM app, checked where they come in. Its own module, importing neither vLLM
nor Ray Serve LLM, so a bad argument is refused at once (serve_llm.py builds the app)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.deploy.serve.app import AppArgsError, args_of

from .model import ensure_tiny_model

DTYPES = ("", "auto", "float32", "float16", "bfloat16")
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
    # The user's own engines: Ray's LLMConfig as a mapping (its YAML, `kvfabric up
    # --config`), served with the fabric (serve_llm.with_fabric). The engine fields above
    # then stay unset: the LLMConfig says them.
    llm_config: dict | None = None

    def __post_init__(self) -> None:
        if self.llm_config is not None:
            if not isinstance(self.llm_config, dict):
                raise AppArgsError(
                    f"llm_config must be a mapping (Ray's LLMConfig), got "
                    f"{type(self.llm_config).__name__}"
                )
            default = LLMAppArgs()
            both = [f for f in ENGINE_FIELDS if getattr(self, f) != getattr(default, f)]
            if both:
                raise AppArgsError(f"with llm_config, set {both} in the LLMConfig instead")
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
        chaos = {}
        if self.chaos_file:  # chaos runs only: production never imports the injectors
            from kvfabric.deploy.chaos.faults import HOOKS, StepFaultFile

            chaos = {"node_hooks": HOOKS, **StepFaultFile.settings(self.chaos_file)}
        return {
            "device_pages": self.device_pages,
            "host_pages": self.host_pages,
            "shards": self.shards,
            "remote": self.remote,
            **chaos,
        }
