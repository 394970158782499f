"""The `kvfabric` command: demo, replay, chaos, up, down and bench, and the clusters
they run on."""
