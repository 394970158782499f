"""An engine's KV events, read from its ZMQ socket and fed to the fabric's index, and the
rule that names a request's pages there and in the connector alike (namespaces.py)."""
