"""A vLLM request's namespace in the fabric: everything besides its token ids that
decides its KV. One rule for the connector (what it stores and loads) and the KV-event
feed (what the index says the engine holds), so both name a page by the same key.

- the tenant, its `cache_salt`: tenants never share;
- the LoRA adapter: its name and the digest of its files (content_digest.py), so an
  adapter's KV never serves the base model, another adapter, or a retrained one;
- multimodal inputs: each item's hash and place (image placeholders are the same token
  ids for every image);
- prompt embeddings: never cached (no namespace).

Only the salt is spelled out ("salt/<salt>"); with an adapter or multimodal inputs the
namespace is a digest of all of them ("inputs/<digest>"), so no salt can spell another
request's namespace.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any, Sequence

from .content_digest import DigestError, DigestTable, folder_digest, resolve_folder

log = logging.getLogger(__name__)

DEFAULT = "default"
SALTED = "salt/"
INPUTS = "inputs/"
MAX_SALT = 4096


def fabric_namespace(
    cache_salt: str | None, lora: str | None = None, mm: Sequence[tuple[str, int, int]] = ()
) -> str:
    """The namespace of a request with this salt, adapter identity and multimodal items
    ((hash, offset, length) each). vLLM hashes a salt of "default" apart from no salt
    and treats an empty salt as none; so does this."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or len(cache_salt) > MAX_SALT):
        raise ValueError(f"cache_salt must be a string of at most {MAX_SALT} characters or None")
    if lora is None and not mm:
        return SALTED + cache_salt if cache_salt else DEFAULT
    text = json.dumps([cache_salt or None, lora, [list(item) for item in mm]])
    return INPUTS + hashlib.blake2b(text.encode(), digest_size=16, person=b"kvf-ns").hexdigest()


class RequestNamespaces:
    """Namespaces of an engine's requests. Keeps each adapter's identity (name and the
    digest of its files, read once per file version) so the KV-event feed, which sees
    an adapter's name only, names its blocks as the connector does."""

    def __init__(self, table: DigestTable | None = None) -> None:
        self.table = table
        self._by_path: dict[tuple[str, str], str] = {}
        self._by_name: dict[str, str] = {}
        self._refused: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # the feed's thread reads what requests add

    def of(self, request: Any) -> str | None:
        """The request's namespace; None when it must not be cached (prompt embeddings,
        or an adapter whose files cannot be read)."""
        if getattr(request, "prompt_embeds", None) is not None:
            return None
        lora = None
        if getattr(request, "lora_request", None) is not None:
            lora = self.adapter(request.lora_request)
            if lora is None:
                return None
        mm = tuple(
            (str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
            for f in getattr(request, "mm_features", None) or ()
        )
        return fabric_namespace(request.cache_salt, lora, mm)

    def adapter(self, lora_request: Any) -> str | None:
        """`name@digest` of a LoRA adapter, or None (warned once) if it cannot be read."""
        key = (str(lora_request.lora_name), str(lora_request.lora_path))
        known = self._by_path.get(key)
        if known is not None:
            self._by_name[key[0]] = known  # the feed follows the latest use of a name
            return known
        if key in self._refused:
            return None
        try:
            digest = folder_digest(resolve_folder(key[1]), self.table)
        except DigestError as e:
            log.warning("LoRA %s: its requests are not cached (%s)", key[0], e)
            self._refused.add(key)
            return None
        identity = f"{key[0]}@{digest}"
        with self._lock:
            self._by_path[key] = identity
            self._by_name[key[0]] = identity
        return identity

    def adapter_named(self, name: str) -> str | None:
        """The identity of the adapter last seen under `name` (None: never seen)."""
        with self._lock:
            return self._by_name.get(name)
