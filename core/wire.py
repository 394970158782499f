"""Checking input from outside: msgpack decoding whose failures become the caller's own
error type, and the type tests every decoder shares."""

from __future__ import annotations

import msgpack


def unpack(data: bytes, error: type[Exception], what: str) -> object:
    """`data` as msgpack (lists for arrays, str map keys only), or raise `error`
    saying it is not a `what`."""
    try:
        return msgpack.unpackb(data, use_list=True, strict_map_key=True)
    except (
        msgpack.UnpackException,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        ValueError,
        TypeError,
    ) as e:
        raise error(f"not a msgpack {what}: {e}") from None


def is_int(value: object) -> bool:
    """An int that is not a bool: JSON and msgpack true/false must not pass as 1/0."""
    return isinstance(value, int) and not isinstance(value, bool)
