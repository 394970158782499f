"""vLLM on the fabric: a generated small full+SWA model and the FabricConnector.

Nothing here is imported by the rest of `deploy` unless the vLLM engine is asked for:
importing vLLM costs seconds."""
