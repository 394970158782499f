"""What both Serve apps (the reference model's and vLLM's) share: app args, tenants and
their API keys, the ingress's auth and error answers, the ingress-to-server protocol, and
the request routers that rank replicas by the fabric's index."""
