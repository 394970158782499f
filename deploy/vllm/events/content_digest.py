"""The content digest of a model's (or a LoRA adapter's) files: two folders whose files
hold the same bytes get the same digest, whatever their paths, and a folder whose files
change (updated in place, another fine-tune under the same name) gets another.

A file in a Hugging Face cache snapshot is a link to a blob named by its content's hash
(SHA-256 for large files, the git blob SHA-1 for small ones): that name is its digest,
nothing to read. Any other file is read once and hashed (BLAKE2b); the result is kept
in a small on-disk table keyed by the file's identity (device, inode, size, mtime,
ctime), so an engine that restarts does not read its weights again, and a file changed
in place (new mtime) is read again. Files that cannot change a page's bytes (tokenizer,
chat template, docs) are left out: they change token ids, which the page keys cover.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DIGEST_CACHE_ENV = "KVF_DIGEST_CACHE"
_CHUNK = 8 << 20
_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_MAX_ENTRIES = 4096  # the table's bound: oldest entries go first
# Files that never change a page's bytes (their effect is on token ids, which keys cover).
_SKIP = re.compile(
    r"(tokenizer.*|vocab.*|merges\.txt|special_tokens_map\.json|added_tokens\.json"
    r"|chat_template.*|.*\.jinja|preprocessor_config\.json|README.*|LICENSE.*|.*\.md"
    r"|\.gitattributes)",
    re.IGNORECASE,
)


class DigestError(ValueError):
    """A model or adapter whose files cannot be found or read."""


def folder_digest(folder: str | Path, table: "DigestTable | None" = None) -> str:
    """The digest of every file under `folder` that can change a page's bytes (32 hex)."""
    root = Path(folder)
    if root.is_file():  # a single-file checkpoint (GGUF, ...)
        files = [root]
        root = root.parent
    elif root.is_dir():
        files = sorted(
            p
            for p in root.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
            and not _SKIP.fullmatch(p.name)
        )
    else:
        raise DigestError(f"{folder}: no such file or folder")
    if not files:
        raise DigestError(f"{folder}: no files that make up a model")
    table = table if table is not None else DigestTable.default()
    whole = hashlib.blake2b(digest_size=16, person=b"kvf-model")
    for path in files:
        rel = path.relative_to(root).as_posix()
        whole.update(f"{len(rel)}:{rel}={file_digest(path, table)};".encode())
    table.save()
    return whole.hexdigest()


def file_digest(path: Path, table: "DigestTable") -> str:
    """`path`'s content hash: its blob's name in a Hugging Face cache, else read once."""
    if path.is_symlink():
        target = Path(os.readlink(path))
        if _BLOB.fullmatch(target.name) and target.parent.name == "blobs":
            return f"blob:{target.name}"
    try:
        st = path.stat()
    except OSError as e:
        raise DigestError(f"{path}: {e}") from None
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    known = table.get(key)
    if known is not None:
        return known
    h = hashlib.blake2b(digest_size=16, person=b"kvf-file")
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError as e:
        raise DigestError(f"{path}: {e}") from None
    digest = f"b2:{h.hexdigest()}"
    table.put(key, digest)
    return digest


def resolve_folder(model: str, revision: str | None = None) -> Path:
    """A local folder or file as is; a hub id's snapshot in the local Hugging Face cache
    (the engine has downloaded it by the time its connector starts)."""
    path = Path(model)
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as e:
        raise DigestError(
            f"model {model!r} is neither a local path nor in the local Hugging Face cache "
            f"({e}); name its content with the connector's model_digest setting"
        ) from None


class DigestTable:
    """File identity -> content digest, kept in one JSON file (written whole, atomically).
    A table that does not parse is ignored (files are read again), never trusted."""

    _default: "DigestTable | None" = None

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, str] = {}
        self.changed = False
        if path is not None and path.exists():
            self.entries = _load(path)

    @classmethod
    def default(cls) -> "DigestTable":
        if cls._default is None:
            where = os.environ.get(DIGEST_CACHE_ENV) or str(
                Path.home() / ".cache" / "ray-kv-fabric" / "digests.json"
            )
            cls._default = cls(Path(where))
        return cls._default

    def get(self, key: str) -> str | None:
        return self.entries.get(key)

    def put(self, key: str, digest: str) -> None:
        self.entries[key] = digest
        while len(self.entries) > _MAX_ENTRIES:
            del self.entries[next(iter(self.entries))]
        self.changed = True

    def save(self) -> None:
        if not self.changed or self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".digests-")
            with os.fdopen(fd, "w") as f:
                json.dump(self.entries, f)
            os.replace(tmp, self.path)
            self.changed = False
        except OSError as e:  # a cache: the next start reads the files again
            log.warning("could not keep file digests in %s: %r", self.path, e)


def _load(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("ignoring the file digest table %s: %r", path, e)
        return {}
    ok = (
        isinstance(data, dict)
        and len(data) <= _MAX_ENTRIES
        and all(
            isinstance(k, str) and len(k) < 200 and isinstance(v, str) and len(v) < 100
            for k, v in data.items()
        )
    )
    if not ok:
        log.warning("ignoring the file digest table %s: not a table of digests", path)
        return {}
    return data
