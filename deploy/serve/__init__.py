"""The Ray Serve application over the reference model: the OpenAI-compatible ingress,
tenants and API keys, the request router, and the model-server deployment."""
