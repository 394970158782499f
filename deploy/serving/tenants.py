"""The tenant table: which API key may use which cache namespaces.

The table comes from a file the operator writes (a Kubernetes Secret mounted as a
file, or a file the cluster launcher copies), JSON or YAML by its extension, one
entry per key:

    "sk-...":                    # the key clients send as "Authorization: Bearer <key>"
      namespaces: [team-a, team-a-eval]
      default: team-a            # optional: the first namespace when left out

It is outside input, so it is decoded strictly: a bad file is an error that names
the entry by its position, never by its key. Keys are kept only as SHA-256 digests
(keys are long random strings, so a plain hash suffices) and matched by comparing
the digest with every entry in constant time, so neither the match nor the time it
takes tells which key, if any, was close.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "MAX_NAME_CHARS",
    "MAX_TABLE_BYTES",
    "MIN_KEY_CHARS",
    "OPEN",
    "Tenant",
    "TenantTable",
    "TenantsError",
    "load_tenants",
    "loads_tenants",
    "parse_tenants",
    "valid_namespace",
]

MAX_NAME_CHARS = 256  # namespaces become cache keys: keep them bounded
MIN_KEY_CHARS = 16  # shorter keys can be guessed; the hash cannot help those
MAX_KEY_CHARS = 1024
MAX_TABLE_BYTES = 1 << 20
ENTRY_FIELDS = frozenset({"namespaces", "default"})


class TenantsError(ValueError):
    """A tenant table that cannot be used. Its message never contains a key."""


@dataclass(frozen=True)
class Tenant:
    """What one API key may use: its namespaces and the one a request gets by default.
    `any_namespace` is only for the single tenant of an app without keys (`OPEN`), whose
    requests that name none run in none, as a vLLM request without a `cache_salt` does
    (cache_namespace.py)."""

    namespaces: tuple[str, ...]
    default: str | None
    any_namespace: bool = False

    def grants(self, namespace: str) -> bool:
        return self.any_namespace or namespace in self.namespaces


# With no table every caller is this one tenant: anyone may use any namespace.
OPEN = Tenant(namespaces=(), default=None, any_namespace=True)


@dataclass(frozen=True)
class _Entry:
    digest: bytes = field(repr=False)
    tenant: Tenant


@dataclass(frozen=True, repr=False)
class TenantTable:
    """Key digests and the tenant each one names. Build it with `parse_tenants` or
    `load_tenants`; its repr says how many keys, nothing of them."""

    entries: tuple[_Entry, ...]

    def __repr__(self) -> str:
        return f"TenantTable({len(self.entries)} keys)"

    def match(self, key: bytes) -> Tenant | None:
        """The tenant of `key`, or None. Every entry is compared, whatever matches."""
        digest = hashlib.sha256(key).digest()
        found = None
        for entry in self.entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry.tenant
        return found


def valid_namespace(name: object) -> bool:
    """A namespace a request or a table may name (the same rule for both)."""
    return type(name) is str and 0 < len(name) <= MAX_NAME_CHARS


def _valid_key(key: object) -> bool:
    # Visible ASCII only: a key must come back unchanged through an HTTP header.
    return (
        type(key) is str
        and MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS
        and all("\x21" <= c <= "\x7e" for c in key)
    )


def _tenant(where: str, value: object) -> Tenant:
    if type(value) is not dict:
        raise TenantsError(
            f"{where}: must be a mapping with 'namespaces' (and optionally 'default'), "
            f"got {type(value).__name__}"
        )
    unknown = [k for k in value if k not in ENTRY_FIELDS]
    if unknown:
        raise TenantsError(f"{where}: unknown fields (only 'namespaces' and 'default' are allowed)")
    names = value.get("namespaces")
    if type(names) is not list or not names:
        raise TenantsError(f"{where}: 'namespaces' must be a non-empty list of namespaces")
    for i, name in enumerate(names):
        if not valid_namespace(name):
            raise TenantsError(
                f"{where}: namespace {i + 1} must be a string of 1 to {MAX_NAME_CHARS} "
                f"characters, got {type(name).__name__}"
            )
    if len(set(names)) != len(names):
        raise TenantsError(f"{where}: a namespace is listed twice")
    default = value.get("default", names[0])
    if default not in names or type(default) is not str:
        raise TenantsError(f"{where}: 'default' must be one of its namespaces")
    return Tenant(tuple(names), default)


def parse_tenants(data: Any, source: str = "tenant table") -> TenantTable:
    """The table from decoded JSON/YAML: a mapping of key -> entry."""
    if type(data) is not dict:
        raise TenantsError(
            f"{source}: must be a mapping of API key -> entry, got {type(data).__name__}"
        )
    if not data:
        raise TenantsError(f"{source}: no keys (to run without keys, set no tenant table)")
    entries = []
    for n, (key, value) in enumerate(data.items(), 1):
        where = f"{source}: entry {n}"
        if not _valid_key(key):
            raise TenantsError(
                f"{where}: the key must be a string of {MIN_KEY_CHARS} to {MAX_KEY_CHARS} "
                f"visible ASCII characters (no spaces)"
            )
        entries.append(_Entry(hashlib.sha256(key.encode("ascii")).digest(), _tenant(where, value)))
    if len({e.digest for e in entries}) != len(
        entries
    ):  # e.g. keys that differ only as YAML saw them
        raise TenantsError(f"{source}: two entries have the same key")
    return TenantTable(tuple(entries))


# --- decoding the file ------------------------------------------------------------------------
def _no_duplicates(pairs: list[tuple[Any, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise TenantsError("two entries of one mapping have the same key")
    return dict(pairs)


def _no_constants(name: str) -> Any:
    raise TenantsError(f"{name} is not valid JSON")


class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses what would hide an entry: duplicate keys (YAML keeps the last)
    and merge keys (`<<`, which copy entries in)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: list[Any] = []
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise TenantsError(
                    f"merge keys ('<<') are not allowed (line {key_node.start_mark.line + 1})"
                )
            key = self.construct_object(key_node, deep=True)
            if any(type(key) is type(k) and key == k for k in seen):
                raise TenantsError(
                    f"two entries of one mapping have the same key "
                    f"(line {key_node.start_mark.line + 1})"
                )
            seen.append(key)
        return super().construct_mapping(node, deep=deep)


def _decode(text: str, suffix: str) -> Any:
    if suffix == ".json":
        try:
            return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
        except json.JSONDecodeError as e:  # its message has positions only, no content
            raise TenantsError(
                f"invalid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
            ) from None
        except TenantsError:
            raise
        except ValueError:  # e.g. an int of more digits than Python converts
            raise TenantsError("invalid JSON (a number out of range)") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except TenantsError:
        raise
    except (ValueError, OverflowError):  # a scalar YAML resolved but Python could not build
        raise TenantsError("invalid YAML (a number or date out of range)") from None
    except yaml.MarkedYAMLError as e:
        # Its message quotes the line, which may hold a key: say where, not what.
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise TenantsError(f"invalid YAML{where}") from None
    except yaml.YAMLError:
        raise TenantsError("invalid YAML") from None


def loads_tenants(content: bytes, suffix: str, source: str = "tenant table") -> TenantTable:
    """The table from a file's bytes; `suffix` (.json, .yaml or .yml) picks the format."""
    if suffix not in (".json", ".yaml", ".yml"):
        raise TenantsError(f"{source}: the file must end in .json, .yaml or .yml")
    if len(content) > MAX_TABLE_BYTES:
        raise TenantsError(f"{source}: larger than {MAX_TABLE_BYTES} bytes")
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TenantsError(f"{source}: not UTF-8 (at byte {e.start})") from None
    try:
        data = _decode(text, suffix)
    except TenantsError as e:
        raise TenantsError(f"{source}: {e}") from None
    except RecursionError:
        raise TenantsError(f"{source}: nested too deeply") from None
    return parse_tenants(data, source)


def load_tenants(path: str | os.PathLike) -> TenantTable:
    """The table in the file at `path` (an absolute path)."""
    p = Path(path)
    if not p.is_absolute():
        raise TenantsError(f"tenant table {p}: the path must be absolute")
    try:
        with open(p, "rb") as f:
            content = f.read(MAX_TABLE_BYTES + 1)
    except OSError as e:
        raise TenantsError(
            f"tenant table {p}: cannot read it ({e.strerror or type(e).__name__})"
        ) from None
    return loads_tenants(content, p.suffix.lower(), f"tenant table {p}")
