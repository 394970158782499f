"""The tenant table (deploy/serving/tenants.py): its file formats, the strict checks with errors
that name an entry by position and never by key, keys held only as digests and matched
against every entry. Fuzzed: tests/deploy/test_fuzz_tenants.py."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import kvfabric.deploy.serving.tenants as tenants_mod
import pytest
import yaml
from kvfabric.deploy.serving.tenants import (
    MAX_NAME_CHARS,
    MAX_TABLE_BYTES,
    Tenant,
    TenantsError,
    load_tenants,
    loads_tenants,
    parse_tenants,
)

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
TABLE = {
    KEY_A: {"namespaces": ["a", "a-eval"]},
    KEY_B: {"namespaces": ["b", "shared"], "default": "shared"},
}


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_json_and_yaml_files_give_the_same_table(tmp_path):
    yml = f"""
{KEY_A}:
  namespaces: [a, a-eval]
"{KEY_B}": {{namespaces: [b, shared], default: shared}}
"""
    for path in (
        write(tmp_path, "t.json", json.dumps(TABLE)),
        write(tmp_path, "t.yaml", yml),
        write(tmp_path, "t.YML", yaml.safe_dump(TABLE)),
    ):
        table = load_tenants(path)
        assert table.match(KEY_A.encode()) == Tenant(("a", "a-eval"), "a")  # default: the first
        assert table.match(KEY_B.encode()) == Tenant(("b", "shared"), "shared")
        for other in (b"", b"sk-tenant-a-012345678", KEY_A.encode() + b"0", KEY_A.upper().encode()):
            assert table.match(other) is None
    assert load_tenants(str(tmp_path / "t.json")) == table  # str paths too


def test_keys_are_kept_only_as_digests():
    table = parse_tenants(TABLE)
    for text in (repr(table), str(table), repr(table.entries), str(vars(table))):
        assert KEY_A not in text and KEY_B not in text and "sk-" not in text
    raw = pickle.dumps(table)
    assert KEY_A.encode() not in raw and KEY_B.encode() not in raw
    assert repr(table) == "TenantTable(2 keys)"


def test_a_match_compares_every_entry(monkeypatch):
    """No early exit: the time a lookup takes does not say which entry, if any, matched."""
    keys = [f"sk-key-{i:02d}-0123456789" for i in range(12)]
    table = parse_tenants({k: {"namespaces": [f"ns{i}"]} for i, k in enumerate(keys)})
    compared = []
    real = tenants_mod.hmac.compare_digest
    monkeypatch.setattr(
        tenants_mod.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b)
    )
    for i, key in enumerate(keys + ["sk-nobody-0123456789"]):
        compared.clear()
        got = table.match(key.encode())
        assert len(compared) == len(keys)
        assert got == (Tenant((f"ns{i}",), f"ns{i}") if i < len(keys) else None)


BAD_TABLES = [
    ([], "must be a mapping"),
    ({}, "no keys"),
    ({"short-key": {"namespaces": ["a"]}}, "entry 1: the key must be"),
    (
        {KEY_A: {"namespaces": ["a"]}, "sk-with space-0123456789": {"namespaces": ["b"]}},
        "entry 2: the key",
    ),
    ({"sk-caf\u00e9-0123456789abc": {"namespaces": ["a"]}}, "visible ASCII"),
    ({KEY_A: ["a"]}, "entry 1: must be a mapping"),
    ({KEY_A: {"namespaces": []}}, "non-empty list"),
    ({KEY_A: {"namespaces": "a"}}, "non-empty list"),
    ({KEY_A: {}}, "non-empty list"),
    ({KEY_A: {"namespaces": ["a", ""]}}, "namespace 2 must be a string"),
    ({KEY_A: {"namespaces": ["a", 5]}}, "namespace 2 must be a string"),
    ({KEY_A: {"namespaces": ["x" * (MAX_NAME_CHARS + 1)]}}, "namespace 1"),
    ({KEY_A: {"namespaces": ["a", "a"]}}, "listed twice"),
    ({KEY_A: {"namespaces": ["a"], "default": "b"}}, "'default' must be one of its namespaces"),
    ({KEY_A: {"namespaces": ["a"], "default": None}}, "'default' must be one of"),
    ({KEY_A: {"namespaces": ["a"], "admin": True}}, "unknown fields"),
]


@pytest.mark.parametrize("data,message", BAD_TABLES, ids=range(len(BAD_TABLES)))
def test_bad_tables_are_refused_by_position_never_by_key(data, message):
    with pytest.raises(TenantsError, match=message) as e:
        parse_tenants(data)
    assert KEY_A not in str(e.value) and "sk-" not in str(e.value)


DUP = f'{{"{KEY_A}": {{"namespaces": ["a"]}}, "{KEY_A}": {{"namespaces": ["b"]}}}}'
BAD_FILES = [
    ("t.json", DUP, "same key"),  # JSON and YAML keep the last one silently
    ("t.yaml", DUP, "same key"),
    ("t.yaml", f"{KEY_A}: {{namespaces: [a]}}\n{KEY_A}: {{namespaces: [b]}}\n", "same key .line 2"),
    ("t.json", f'{{"{KEY_A}": {{"namespaces": ["a"], "namespaces": ["b"]}}}}', "same key"),
    ("t.yaml", f"base: &b {{namespaces: [a]}}\n{KEY_A}:\n  <<: *b\n", "merge keys"),
    ("t.yaml", f"{KEY_A}: {{namespaces: [a]\n", "invalid YAML at line"),
    ("t.json", f'{{"{KEY_A}": ', "invalid JSON"),
    ("t.json", f'{{"{KEY_A}": {{"namespaces": ["a"]}}, "x": NaN}}', "NaN"),
    ("t.json", "1" * 5000, "invalid JSON"),
    ("t.yaml", "[" * 100_000, "nested too deeply|invalid YAML"),
    ("t.yaml", f"{KEY_A}: {{namespaces: [a]}}\n\x00", "invalid YAML"),
    ("t.yaml", b"\xff" + KEY_A.encode(), "not UTF-8"),
    ("t.yaml", "", "must be a mapping"),
    ("t.yaml", "yes", "must be a mapping"),
    ("t.toml", json.dumps(TABLE), ".json, .yaml or .yml"),
    ("t.json", " " * (MAX_TABLE_BYTES + 1), "larger than"),
]


@pytest.mark.parametrize("name,content,message", BAD_FILES, ids=range(len(BAD_FILES)))
def test_bad_files_are_refused_without_quoting_them(tmp_path, name, content, message):
    with pytest.raises(TenantsError, match=message) as e:
        load_tenants(write(tmp_path, name, content))
    assert "sk-" not in str(e.value) and str(e.value).startswith(
        f"tenant table {tmp_path / name}: "
    )


def test_unreadable_or_relative_paths(tmp_path):
    with pytest.raises(TenantsError, match="cannot read"):
        load_tenants(tmp_path / "missing.yaml")
    with pytest.raises(TenantsError, match="cannot read"):
        load_tenants(tmp_path)  # a directory
    with pytest.raises(TenantsError, match="absolute"):
        load_tenants("tenants.yaml")


def test_yaml_errors_quote_no_line_of_the_file():
    # PyYAML's own message quotes the offending line, which holds a key here.
    with pytest.raises(TenantsError) as e:
        loads_tenants(f'{KEY_A}: {{namespaces: [a]}}\n"{KEY_B}: @\n'.encode(), ".yaml")
    assert "sk-" not in str(e.value) and "line" in str(e.value)
