"""deploy: what users run on top of the fabric: the Ray Serve apps (the reference model
server and, in `vllm/`, vLLM's connector, router and ingress), the `kvfabric` CLI and its
demos, the replay simulator and the chaos harness."""
