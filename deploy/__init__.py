"""deploy: the `kvfabric` CLI, demos and (later) the Ray Serve app."""
