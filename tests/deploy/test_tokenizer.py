"""The reference model's byte tokenizer (deploy/reference/tokenizer.py): text round-trips,
and what it refuses or skips."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.deploy.reference.tokenizer import OFFSET, ByteTokenizer

from tests.deploy.ingress_backends import TOK


@given(st.text())
def test_tokenizer_round_trips_text(text):
    ids = TOK.encode(text)
    assert all(OFFSET <= i < OFFSET + 256 for i in ids)
    assert TOK.decode(ids) == text


def test_tokenizer_edges():
    for vocab, error in ((257, ValueError), (True, TypeError), (300.0, TypeError)):
        with pytest.raises(error):
            ByteTokenizer(vocab)
    assert TOK.decode([0, 1, OFFSET + 104, 300, 511, -5, OFFSET + 105]) == "hi"
    assert TOK.decode([OFFSET + 0xFF, OFFSET + 104]) == "\ufffdh"
    with pytest.raises(ValueError, match="not valid Unicode"):
        TOK.encode("a\ud800")
    with pytest.raises(TypeError):
        TOK.decode([1.5])
