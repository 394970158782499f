"""A request's cache namespace: everything besides its token ids that decides which
cached pages it may use. One function for both apps, the vLLM connector, the KV-event
feed and the routers, so each names a page by the same key.

The words, one meaning each:
- a *tenant* is what an API key grants (tenants.py): one or more namespaces, one of
  them its default;
- a request's *namespace* is the one it names: vLLM's `cache_salt` field (the reference
  app also reads `kvfabric.namespace`), one its key's tenant grants; any without a
  tenant table;
- its *cache namespace*, what the fabric files its pages under, is that namespace
  spelled "salt/<namespace>" ("default" for none), or, with a LoRA adapter or
  multimodal inputs, a digest of all of them ("inputs/<digest>"), so no namespace can
  spell another request's cache namespace. Tenants never share pages.
The Ray namespace the fabric's actors live in is another thing: `ray_namespace`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

__all__ = ["DEFAULT", "INPUTS", "MAX_CHARS", "SALTED", "cache_namespace"]

DEFAULT = "default"
SALTED = "salt/"
INPUTS = "inputs/"
MAX_CHARS = 4096  # a namespace without a tenant table is the client's: keep keys bounded


def cache_namespace(
    namespace: str | None, lora: str | None = None, mm: Sequence[tuple[str, int, int]] = ()
) -> str:
    """The cache namespace of a request in `namespace` (its `cache_salt`), adapter
    identity (`name@digest`) and multimodal items ((hash, offset, length) each). vLLM
    hashes a salt of "default" apart from no salt and treats an empty salt as none; so
    does this."""
    if namespace is not None and (not isinstance(namespace, str) or len(namespace) > MAX_CHARS):
        raise ValueError(f"a namespace (cache_salt) must be a string of at most {MAX_CHARS} chars")
    if lora is None and not mm:
        return SALTED + namespace if namespace else DEFAULT
    text = json.dumps([namespace or None, lora, [list(item) for item in mm]])
    return INPUTS + hashlib.blake2b(text.encode(), digest_size=16, person=b"kvf-ns").hexdigest()
