"""A byte-level tokenizer for the reference model.

TinyLM has no trained vocabulary, so text maps to its UTF-8 bytes: byte b is
id b + OFFSET. The ids below OFFSET are reserved (padding, end of text) and never
produced by `encode`; ids at or above OFFSET + 256 exist in the model's vocab (512
by default) but stand for no byte, so `decode` skips them. Any text round-trips.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["ByteTokenizer", "OFFSET", "PAD_ID", "EOS_ID"]

PAD_ID = 0
EOS_ID = 1
OFFSET = 2  # reserved ids before the 256 byte ids


class ByteTokenizer:
    """UTF-8 bytes shifted by OFFSET; needs a vocab of at least OFFSET + 256 ids."""

    def __init__(self, vocab: int) -> None:
        if not isinstance(vocab, int) or isinstance(vocab, bool):
            raise TypeError(f"vocab must be an int, got {type(vocab).__name__}")
        if vocab < OFFSET + 256:
            raise ValueError(
                f"a byte tokenizer needs a vocab of at least {OFFSET + 256} ids, got {vocab}"
            )
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Raises ValueError for strings that are not valid
        Unicode (lone surrogates, which JSON's \\ud800 escapes can produce)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"text is not valid Unicode: {e.reason} at position {e.start}"
            ) from None
        return [b + OFFSET for b in data]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`: ids that stand for no byte are skipped, and byte runs that
        are not valid UTF-8 (a model may emit any bytes) become U+FFFD."""
        data = bytearray()
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool):
                raise TypeError(f"token ids must be ints, got {i!r}")
            if OFFSET <= i < OFFSET + 256:
                data.append(i - OFFSET)
        return data.decode("utf-8", errors="replace")
