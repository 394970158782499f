"""The switch between the C extension and the pure-Python reference: KVF_NATIVE.

0: pure Python. 1: the extension, or an ImportError at import. auto (the default): the
extension, or pure Python with one warning when it cannot load (a checkout that was
never built). The choice is made once, at import; both paths give the same bytes.
"""

from __future__ import annotations

import enum
import os
import warnings
from types import ModuleType
from typing import Callable, Protocol


class Mode(enum.Enum):
    OFF = "0"
    ON = "1"
    AUTO = "auto"


class KeysExtension(Protocol):
    """What core/cache/csrc/keys.c exports (the `_pagekeys` module)."""

    KEY_BYTES: int
    MAX_PAGE_SIZE: int

    def pack(self, tokens: object, /) -> bytes: ...

    def equal(self, tokens: object, raw: bytes, /) -> bool: ...

    def pack_keys(
        self, tokens: object, key: bytes, prev: bytes, first_page: int, page_size: int, /
    ) -> tuple[bytes, list[bytes]]: ...

    def chain(
        self, raw: object, key: bytes, prev: bytes, first_page: int, page_size: int, /
    ) -> list[bytes]: ...

    def blake2b(self, data: object, key: bytes, digest_size: int, /) -> bytes: ...

    def set_error(self, cls: type[Exception], /) -> None: ...


def mode_from(value: str | None) -> Mode:
    """The mode a KVF_NATIVE value names (unset: auto); a clear ValueError otherwise."""
    if value is None:
        return Mode.AUTO
    try:
        return Mode(value.strip().lower())
    except ValueError:
        raise ValueError(f"KVF_NATIVE must be one of 0, 1, auto, got {value!r}") from None


def load(mode: Mode, importer: Callable[[], ModuleType]) -> ModuleType | None:
    """The extension `importer` imports, under `mode`; None for pure Python."""
    if mode is Mode.OFF:
        return None
    try:
        return importer()
    except ImportError as e:
        if mode is Mode.ON:
            raise ImportError(
                f"KVF_NATIVE=1 but the native extension does not load ({e}); "
                "build it with `pip install -e .` or set KVF_NATIVE=0"
            ) from e
        warnings.warn(
            f"kvfabric: the native extension does not load ({e}); using pure Python "
            "(`pip install -e .` builds it; KVF_NATIVE=0 silences this)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _import_keys() -> ModuleType:
    from . import _pagekeys  # type: ignore[attr-defined]  # built C: mypy sees no source

    return _pagekeys


def load_keys(mode: Mode) -> KeysExtension | None:
    """The keys extension under `mode`, or None for pure Python."""
    ext: KeysExtension | None = load(mode, _import_keys)  # type: ignore[assignment]
    return ext


MODE = mode_from(os.environ.get("KVF_NATIVE"))
KEYS = load_keys(MODE)
ENABLED = KEYS is not None
