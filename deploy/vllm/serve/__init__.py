"""The Ray Serve LLM app over vLLM engines with the fabric: its args, ingress, router and
builder, and the small generated model it serves by default."""
