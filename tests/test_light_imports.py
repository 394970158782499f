"""What a process imports sets its start time and its memory: `import kvfabric` and its
layers' packages import nothing until a name is used, and an index shard's process (the
index, its routes, the wire types) never imports torch, NIXL or the node cache, which
would cost it seconds of CPU at start and ~300 MB."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

HEAVY = ("torch", "nixl", "ray", "kvfabric.core.cache.node_cache", "kvfabric.actors.client")
LIGHT = {
    "kvfabric": HEAVY,
    "kvfabric.core": HEAVY,
    "kvfabric.actors": HEAVY,
    "kvfabric.core.index.prefix_index": HEAVY,
    "kvfabric.actors.index_shard": ("torch", "nixl", "kvfabric.core.cache.node_cache"),
}


def imported(module: str, names: tuple[str, ...]) -> list[str]:
    """Which of `names` (or a module under one) a fresh interpreter holds after importing
    `module`."""
    code = (
        f"import sys, {module}\n"
        f"print([n for n in {names!r} if any(m == n or m.startswith(n + '.') "
        "for m in sys.modules)])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return ast.literal_eval(out.stdout.strip())


@pytest.mark.parametrize("module", sorted(LIGHT))
def test_importing_leaves_the_heavy_modules_out(module):
    assert imported(module, LIGHT[module]) == []


def test_the_check_sees_a_heavy_import():
    assert imported("kvfabric.core.cache.pools", ("torch",)) == ["torch"]


def test_each_public_name_still_resolves():
    import kvfabric.actors
    import kvfabric.core

    import kvfabric

    for package in (kvfabric, kvfabric.core, kvfabric.actors):
        for name in package.__all__:
            assert getattr(package, name) is not None, (package.__name__, name)
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            package.nope  # noqa: B018
