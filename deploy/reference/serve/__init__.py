"""The Ray Serve application over the reference model: the OpenAI-compatible ingress, its
way to the model servers, and the model-server deployment."""
