"""A byte-level tokenizer for the reference model.

TinyLM has no trained vocabulary, so text maps to its UTF-8 bytes: byte b is
id b + OFFSET. The ids below OFFSET are reserved (padding, end of text) and never
produced by `encode`; ids at or above OFFSET + 256 exist in the model's vocab (512
by default) but stand for no byte, so `decode` skips them. Any text round-trips.

A chat is the model's chat format: each message its role's token, its content's bytes and
an end-of-turn token, then the assistant's role token. The role tokens lie above the bytes,
so no text can forge a turn (as a trained model's special tokens).
"""

from __future__ import annotations

import codecs
from typing import Iterable, Iterator, Sequence

__all__ = ["ByteTokenizer", "OFFSET", "PAD_ID", "EOS_ID", "ROLES"]

PAD_ID = 0
EOS_ID = 1
OFFSET = 2  # reserved ids before the 256 byte ids
ROLES = ("system", "user", "assistant")  # the chat format's roles: ids OFFSET + 256 + i
END_OF_TURN = OFFSET + 256 + len(ROLES)


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

    def decode_pieces(self, ids: Sequence[int]) -> Iterator[str]:
        """`decode(ids)` a token at a time, for streaming: a character split over several
        tokens comes whole with its last one, so the pieces join to `decode(ids)`."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool):
                raise TypeError(f"token ids must be ints, got {i!r}")
            yield decoder.decode(bytes([i - OFFSET]) if OFFSET <= i < OFFSET + 256 else b"")
        yield decoder.decode(b"", final=True)

    def encode_chat(self, messages: Iterable[tuple[str, str]]) -> list[int]:
        """Token ids of a chat of (role, content) messages, ready for the assistant's turn.
        Raises ValueError for an unknown role, or content that is not valid Unicode."""
        if self.vocab <= END_OF_TURN:
            raise ValueError(f"the chat format needs a vocab above {END_OF_TURN}, got {self.vocab}")
        ids: list[int] = []
        for role, content in messages:
            if role not in ROLES:
                raise ValueError(f"role must be one of {list(ROLES)}, got {role!r}")
            ids += [OFFSET + 256 + ROLES.index(role), *self.encode(content), END_OF_TURN]
        return ids + [OFFSET + 256 + ROLES.index("assistant")]
