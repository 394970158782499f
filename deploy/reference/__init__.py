"""The reference engine: a tiny bit-exact full+SWA transformer, its byte tokenizer, and
the per-node engine that serves it from the fabric."""
