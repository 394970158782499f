"""Which fabric serves a model: engines announce the Ray namespace of their fabric under
the name they serve, so a request router that knows only that name finds the index.

Kept in Ray's GCS key-value store (as epochs are, actors/epochs.py): it outlives every
actor. A model may be served by more than one fabric (engines of one name but another
KV identity, as on nodes whose CPU kernels differ)."""

from __future__ import annotations

NAMESPACE = "kvfabric"
_PREFIX = "served/"
MAX_NAME = 512


def announce(model: str, ray_namespace: str) -> None:
    """Say that engines serving `model` cache in the fabric of `ray_namespace`."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_key(model, ray_namespace), b"", True, namespace=NAMESPACE)


def fabrics_of(model: str) -> list[str]:
    """The namespaces of the fabrics engines serving `model` announced, sorted."""
    from ray.experimental import internal_kv

    prefix = _key(model, "")
    keys = internal_kv._internal_kv_list(prefix, namespace=NAMESPACE)
    return sorted(k[len(prefix) :].decode() for k in keys)


def announced() -> list[tuple[str, str]]:
    """Every (model, fabric namespace) announced, sorted."""
    from ray.experimental import internal_kv

    out = []
    for key in internal_kv._internal_kv_list(_PREFIX.encode(), namespace=NAMESPACE):
        size, _, rest = key.decode()[len(_PREFIX) :].partition(":")
        if size.isdigit() and rest[int(size) : int(size) + 1] == "\n":
            out.append((rest[: int(size)], rest[int(size) + 1 :]))
    return sorted(out)


def forget_all() -> int:
    """Forget every announcement (the fabrics are gone: `kvfabric down`); how many."""
    from ray.experimental import internal_kv

    keys = internal_kv._internal_kv_list(_PREFIX.encode(), namespace=NAMESPACE)
    for key in keys:
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)
    return len(keys)


def _key(model: str, ray_namespace: str) -> bytes:
    if not isinstance(model, str) or not 0 < len(model) <= MAX_NAME or "\n" in model:
        raise ValueError(
            f"a served model's name must be 1..{MAX_NAME} characters, got {model!r:.80}"
        )
    return f"{_PREFIX}{len(model)}:{model}\n{ray_namespace}".encode()
