"""The FabricConnector: vLLM's KV connector, run inside each engine (its scheduler side
in EngineCore, its worker side in each worker process). vLLM loads it by this package's
name: kv_connector="FabricConnector", kv_connector_module_path="kvfabric.deploy.vllm.connector"
(`kv_transfer_config` writes both)."""

from .fabric_connector import FabricConnector, kv_transfer_config

__all__ = ["FabricConnector", "kv_transfer_config"]
