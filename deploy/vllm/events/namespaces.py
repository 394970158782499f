"""A vLLM request's cache namespace (deploy/serving/cache_namespace.py, one rule for
both apps) from what vLLM's request carries: its `cache_salt`; its LoRA adapter, by name
and the digest of its files (content_digest.py), so an adapter's KV never serves the
base model, another adapter, or a retrained one; its multimodal inputs, each item's hash
and place (image placeholders are the same token ids for every image). Prompt embeddings
are never cached (no namespace). The connector (what it stores and loads) and the
KV-event feed (what the index says the engine holds) both name pages through it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvfabric.deploy.serving.cache_namespace import cache_namespace

from .content_digest import DigestError, DigestTable, folder_digest, resolve_folder

log = logging.getLogger(__name__)


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
        return cache_namespace(request.cache_salt, lora, mm)

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
