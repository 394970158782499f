"""vLLM on the fabric, as three parts by who runs them: the FabricConnector inside each
engine (connector/), the feed of an engine's KV events to the index (events/), and the
Ray Serve LLM app around the engines (serve/).

Nothing here is imported by the rest of `deploy` unless the vLLM engine is asked for:
importing vLLM costs seconds."""
