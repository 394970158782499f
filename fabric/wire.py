"""Decoding msgpack from outside: any failure becomes the caller's own error type."""
from __future__ import annotations

import msgpack


def unpack(data: bytes, error: type[Exception], what: str) -> object:
    """`data` as msgpack (lists for arrays, str map keys only), or raise `error`
    saying it is not a `what`."""
    try:
        return msgpack.unpackb(data, use_list=True, strict_map_key=True)
    except (msgpack.UnpackException, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            ValueError, TypeError) as e:
        raise error(f"not a msgpack {what}: {e}") from None
