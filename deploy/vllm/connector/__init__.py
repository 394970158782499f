"""The FabricConnector: vLLM's KV connector, run inside each engine (its scheduler side
in EngineCore, its worker side in each worker process)."""
