"""Fuzzing the tenant table's decoder (deploy/serving/tenants.py), outside input like the other
files (tests/deploy/test_fuzz_files.py): valid tables round-trip through JSON and YAML, mutated
ones are accepted iff valid, arbitrary bytes load or raise TenantsError, and no error
message ever quotes a key."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.deploy.serving.tenants import (
    MAX_KEY_CHARS,
    MAX_NAME_CHARS,
    MIN_KEY_CHARS,
    TenantsError,
    loads_tenants,
    parse_tenants,
)

from tests.fuzzing import NEAR, RANDOM, flipped, fuzz, mutated

pytestmark = pytest.mark.fuzz

VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
# Every key starts "sk-": an error message holding "sk-" quotes one.
KEYS = st.text(VISIBLE, min_size=MIN_KEY_CHARS - 3, max_size=40).map(lambda s: "sk-" + s)
NAMES = st.text(min_size=1, max_size=8).filter(lambda s: "sk-" not in s) | st.sampled_from(
    ["a", "b", "default"]
)
FIELDS = ["namespaces", "default"]


@st.composite
def entries(draw: st.DrawFn) -> dict:
    names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    entry: dict[str, Any] = {"namespaces": names}
    if draw(st.booleans()):
        entry["default"] = draw(st.sampled_from(names))
    return entry


TABLES = st.dictionaries(KEYS, entries(), min_size=1, max_size=4)


def table_ok(d: object) -> bool:
    if type(d) is not dict or not d:
        return False
    for key, entry in d.items():
        if not (
            type(key) is str
            and MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS
            and all(0x21 <= ord(c) <= 0x7E for c in key)
        ):
            return False
        if type(entry) is not dict or not set(entry) <= set(FIELDS):
            return False
        names = entry.get("namespaces")
        if not (
            type(names) is list
            and names
            and len(set(map(repr, names))) == len(names)
            and all(type(n) is str and 0 < len(n) <= MAX_NAME_CHARS for n in names)
        ):
            return False
        if "default" in entry and not (type(entry["default"]) is str and entry["default"] in names):
            return False
    return True


def encode(table: dict, fmt: str) -> bytes:
    # Escaped: PyYAML writes a raw NEL (U+0085) with allow_unicode and reads it back as a space.
    text = json.dumps(table) if fmt == ".json" else yaml.safe_dump(table, allow_unicode=False)
    return text.encode()


def assert_serves(table, d: dict) -> None:
    for key, entry in d.items():
        tenant = table.match(key.encode())
        assert tenant is not None and tenant.namespaces == tuple(entry["namespaces"])
        assert (
            tenant.default == entry.get("default", entry["namespaces"][0])
            and not tenant.any_namespace
        )
        assert table.match(key.encode() + b"!") is None and table.match(key[:-1].encode()) is None
    assert len(table.entries) == len(d)


@fuzz
@given(TABLES, st.sampled_from([".json", ".yaml", ".yml"]))
def test_tables_round_trip_through_both_formats(d: dict, fmt: str) -> None:
    assert_serves(loads_tenants(encode(d, fmt), fmt), d)


@fuzz
@given(
    st.one_of(
        RANDOM,
        TABLES.flatmap(
            lambda d: mutated(
                d,
                NEAR | NAMES | KEYS | st.lists(NAMES, max_size=3),
                st.sampled_from([*FIELDS, "x", 0]) | KEYS,
            )
        ),
    )
)
def test_tables_are_accepted_iff_valid(d: Any) -> None:
    try:
        table = parse_tenants(d)
    except TenantsError as e:
        assert not table_ok(d), d
        assert "sk-" not in str(e)
        return
    assert table_ok(d), d
    assert_serves(table, d)


FILES = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=100).map(str.encode),
    st.tuples(TABLES, st.sampled_from([".json", ".yaml"]))
    .map(lambda t: encode(*t))
    .flatmap(flipped),
    st.sampled_from(
        [
            b"[" * 50_000,
            b"{" * 50_000,
            b"1" * 5000,
            b"!!binary xyz",
            b"? [a]\n: b",
            b"&a [*a]",
            b"2001-13-45: x",
            b"\xef\xbb\xbf{}",
            b"- !!python/object:os.system ls",
        ]
    ),
)


@fuzz
@given(FILES, st.sampled_from([".json", ".yaml", ".yml"]))
def test_any_bytes_load_or_raise_tenants_error(content: bytes, fmt: str) -> None:
    try:
        table = loads_tenants(content, fmt)
    except TenantsError as e:
        assert "sk-" not in str(e) and str(e).startswith("tenant table: ")
        return
    assert table.entries and all(len(e.digest) == 32 for e in table.entries)
