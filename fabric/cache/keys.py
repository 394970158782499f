"""Chained page keys: k_i = H(k_{i-1} || tokens of page i), keyed by namespace.

H is BLAKE2b keyed by a digest of the namespace, so a key names a whole prefix,
two tenants never share keys, and one tenant cannot probe for another's prompts.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Sequence

KEY_BYTES = 16


class KeyError_(ValueError):
    """Bad input to page-key computation (named to avoid shadowing KeyError)."""


def namespace_key(namespace: str) -> bytes:
    if not isinstance(namespace, str) or not namespace:
        raise KeyError_(f"namespace must be a non-empty str, got {namespace!r}")
    return hashlib.blake2b(namespace.encode(), digest_size=32, person=b"kvf-ns").digest()


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as int32 bytes: what page keys hash and what tree nodes compare."""
    try:
        return struct.pack(f"{len(tokens)}i", *tokens)
    except (struct.error, TypeError) as e:
        raise KeyError_(f"tokens must be int32 token ids: {e}") from e


class PageKeyer:
    """Computes the chained keys of one namespace under one layout."""

    __slots__ = ("page_size", "page_bytes", "root", "_hasher")

    def __init__(self, namespace: str, fingerprint: bytes, page_size: int) -> None:
        self.page_size = page_size
        self.page_bytes = page_size * 4
        self._hasher = hashlib.blake2b(key=namespace_key(namespace), digest_size=KEY_BYTES)
        h = self._hasher.copy()
        h.update(fingerprint)
        self.root = h.digest()

    def keys(self, tokens: Sequence[int], start_key: bytes | None = None) -> list[bytes]:
        """Keys of every whole page of `tokens`; a trailing partial page has none."""
        return self.chain(encode_tokens(tokens), start_key)

    def chain(self, raw: bytes, prev: bytes | None = None, first_page: int = 0) -> list[bytes]:
        """Keys of the whole pages of encoded tokens from `first_page` on, chained
        from `prev` (the key of page first_page - 1, or the namespace root)."""
        step = self.page_bytes
        prev = self.root if prev is None else prev
        copy, view = self._hasher.copy, memoryview(raw)
        out: list[bytes] = []
        append = out.append
        for off in range(first_page * step, len(raw) - step + 1, step):
            h = copy()
            h.update(prev)
            h.update(view[off:off + step])
            prev = h.digest()
            append(prev)
        return out


class KeyerCache:
    """The keyers of recently used namespaces, at most `size` of them (least recently
    used dropped first): a keyer is cheap to rebuild, and tenants are unbounded."""

    def __init__(self, fingerprint: bytes, page_size: int, size: int = 1024) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        self.fingerprint, self.page_size, self.size = fingerprint, page_size, size
        self._keyers: OrderedDict[str, PageKeyer] = OrderedDict()

    def get(self, namespace: str) -> PageKeyer:
        keyer = self._keyers.get(namespace)
        if keyer is not None:
            self._keyers.move_to_end(namespace)
            return keyer
        keyer = PageKeyer(namespace, self.fingerprint, self.page_size)
        self._keyers[namespace] = keyer
        if len(self._keyers) > self.size:
            self._keyers.popitem(last=False)
        return keyer

    def __len__(self) -> int:
        return len(self._keyers)
