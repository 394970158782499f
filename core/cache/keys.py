"""Chained page keys: k_i = H(k_{i-1} || tokens of page i), keyed by namespace.

H is BLAKE2b keyed by a digest of the namespace, so a key names a whole prefix,
two tenants never share keys, and one tenant cannot probe for another's prompts.

Two implementations give the same bytes and the same errors: the C extension
(core/cache/csrc/, one call per request) and the pure-Python reference below;
KVF_NATIVE picks one per process (native.py).
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections import OrderedDict
from typing import Callable, Sequence

from . import native
from .native import KeysExtension

KEY_BYTES = 16
MAX_PAGE_SIZE = 1 << 20  # a sanity bound: page_size * 4 bytes must fit any index type

# Token ids: a sequence of ints (list, tuple, range) or a 1-D buffer of integers
# (array('q'), a numpy array, bytes); any sized iterable of ints is packed too.
Tokens = Sequence[int]


class KeyError_(ValueError):
    """Bad input to page-key computation (named to avoid shadowing KeyError)."""


EXT: KeysExtension | None = native.KEYS
if EXT is not None:
    if (EXT.KEY_BYTES, EXT.MAX_PAGE_SIZE) != (KEY_BYTES, MAX_PAGE_SIZE):
        raise ImportError(
            f"the native extension is stale (KEY_BYTES {EXT.KEY_BYTES}, MAX_PAGE_SIZE "
            f"{EXT.MAX_PAGE_SIZE}): rebuild it with `pip install -e .`"
        )
    EXT.set_error(KeyError_)


def namespace_key(namespace: str) -> bytes:
    if not isinstance(namespace, str) or not namespace:
        raise KeyError_(f"namespace must be a non-empty str, got {namespace!r}")
    return hashlib.blake2b(namespace.encode(), digest_size=32, person=b"kvf-ns").digest()


def pack_py(tokens: Tokens) -> bytes:
    """The reference packing: struct's, with the native path's errors."""
    try:
        return struct.pack(f"{len(tokens)}i", *tokens)
    except (struct.error, TypeError):
        pass  # raised below, outside the handler: struct's error is not the cause users need
    raise KeyError_(_token_error(tokens))


def packs_to_py(tokens: Tokens, raw: bytes) -> bool:
    return pack_py(tokens) == raw


# Bound once, not dispatched per call: both run twice a request.
# encode_tokens(tokens): token ids as int32 bytes, what page keys hash and tree nodes compare.
encode_tokens: Callable[[Tokens], bytes] = pack_py if EXT is None else EXT.pack
# packs_to(tokens, raw): whether `tokens` encode to exactly `raw`. The native path compares
# a list or tuple of ints in place, without packing it, and answers False as soon as they
# differ; a bad token it reads raises as encode_tokens would.
packs_to: Callable[[Tokens, bytes], bool] = packs_to_py if EXT is None else EXT.equal


def _token_error(tokens: Tokens) -> str:
    """What is wrong with tokens struct would not pack (the first bad token)."""
    try:
        n = len(tokens)
    except TypeError:
        return f"tokens must be a sequence of int32 token ids, got {type(tokens).__name__}"
    items = tuple(tokens)
    for i, t in enumerate(items):
        try:
            v = operator.index(t)
        except TypeError:
            return f"tokens must be int32 token ids: token {i} is {t!r}, not an int"
        if not -(2**31) <= v < 2**31:
            return f"tokens must be int32 token ids: token {i} is {v}, outside int32"
    if len(items) != n:
        return "tokens must be int32 token ids: their length changed while packing"
    return "tokens must be int32 token ids"


class PageKeyer:
    """Computes the chained keys of one namespace under one layout. `native`: which
    implementation (default: the process's, KVF_NATIVE); tests compare the two."""

    __slots__ = ("page_size", "page_bytes", "key", "root", "_hasher", "_ext")

    def __init__(
        self, namespace: str, fingerprint: bytes, page_size: int, *, native: bool | None = None
    ) -> None:
        if type(page_size) is not int or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise KeyError_(
                f"page_size must be an int from 1 to {MAX_PAGE_SIZE}, got {page_size!r}"
            )
        if not isinstance(fingerprint, bytes):
            raise KeyError_(f"fingerprint must be bytes, got {type(fingerprint).__name__}")
        if native and EXT is None:
            raise RuntimeError("native keys asked for, but the native extension is not loaded")
        self.page_size = page_size
        self.page_bytes = page_size * 4
        self.key = namespace_key(namespace)
        self._hasher = hashlib.blake2b(key=self.key, digest_size=KEY_BYTES)
        h = self._hasher.copy()
        h.update(fingerprint)
        self.root = h.digest()
        self._ext = EXT if native is None or native else None

    def keys(self, tokens: Tokens, start_key: bytes | None = None) -> list[bytes]:
        """Keys of every whole page of `tokens`; a trailing partial page has none."""
        return self.pack(tokens, start_key)[1]

    def pack(
        self, tokens: Tokens, prev: bytes | None = None, first_page: int = 0
    ) -> tuple[bytes, list[bytes]]:
        """`tokens` packed (encode_tokens) and the keys of their whole pages from
        `first_page` on, chained from `prev` (as `chain`): one native call."""
        prev = self.root if prev is None else prev
        if self._ext is not None:
            return self._ext.pack_keys(tokens, self.key, prev, first_page, self.page_size)
        _check_chain(prev, first_page)
        raw = pack_py(tokens)
        return raw, self._chain_py(memoryview(raw), prev, first_page)

    def chain(self, raw: bytes, prev: bytes | None = None, first_page: int = 0) -> list[bytes]:
        """Keys of the whole pages of encoded tokens from `first_page` on, chained
        from `prev` (the key of page first_page - 1, or the namespace root)."""
        prev = self.root if prev is None else prev
        if self._ext is not None:
            return self._ext.chain(raw, self.key, prev, first_page, self.page_size)
        _check_chain(prev, first_page)
        try:
            view = memoryview(raw).cast("B")
        except TypeError:
            raise KeyError_(
                f"raw must be a contiguous bytes-like object, got {type(raw).__name__}"
            ) from None
        return self._chain_py(view, prev, first_page)

    def _chain_py(self, view: memoryview, prev: bytes, first_page: int) -> list[bytes]:
        step = self.page_bytes
        copy = self._hasher.copy
        out: list[bytes] = []
        append = out.append
        for off in range(first_page * step, len(view) - step + 1, step):
            h = copy()
            h.update(prev)
            h.update(view[off : off + step])
            prev = h.digest()
            append(prev)
        return out


def _check_chain(prev: object, first_page: object) -> None:
    """The reference's checks of a chain's start, as the native call makes them."""
    if not isinstance(prev, bytes) or len(prev) != KEY_BYTES:
        raise KeyError_(f"prev must be a {KEY_BYTES}-byte page key, got {prev!r}")
    if not isinstance(first_page, int) or first_page < 0:
        raise KeyError_(f"first_page must be an int >= 0, got {first_page!r}")


class KeyerCache:
    """The keyers of recently used namespaces, at most `size` of them (least recently
    used dropped first): a keyer is cheap to rebuild, and tenants are unbounded."""

    def __init__(self, fingerprint: bytes, page_size: int, size: int = 1024) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        self.fingerprint, self.page_size, self.size = fingerprint, page_size, size
        self._keyers: OrderedDict[str, PageKeyer] = OrderedDict()
        self._last: PageKeyer | None = None  # the most recently used: at the end already

    def get(self, namespace: str) -> PageKeyer:
        keyer = self._keyers.get(namespace)
        if keyer is not None:
            if self._last is not keyer:  # requests come in runs of one tenant: skip the move
                self._keyers.move_to_end(namespace)
                self._last = keyer
            return keyer
        keyer = PageKeyer(namespace, self.fingerprint, self.page_size)
        self._keyers[namespace] = keyer
        self._last = keyer
        if len(self._keyers) > self.size:
            self._keyers.popitem(last=False)
        return keyer

    def __len__(self) -> int:
        return len(self._keyers)
