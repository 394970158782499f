"""Every wait on Ray is bounded, read from the sources: each `ray.get` and `ray.wait` in
the package, the benchmarks and the tests names a timeout. An unbounded one hangs a
chaos run, a bench or CI on the one actor that never answers, where a bounded one fails
naming it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("core", "transport", "actors", "deploy", "kvfabric", "benchmarks", "tests")
# The timeout's position where it is given without its name: ray.get(refs, timeout),
# ray.wait(refs, num_returns, timeout).
POSITION = {"get": 1, "wait": 2}


def unbounded(source: str) -> list[int]:
    """The lines of `source` with a ray.get or ray.wait that names no timeout."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if not (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "ray"
            and n.func.attr in POSITION
        ):
            continue
        named = any(k.arg == "timeout" or k.arg is None for k in n.keywords)  # or **kwargs
        if not named and len(n.args) <= POSITION[n.func.attr]:
            out.append(n.lineno)
    return out


def test_the_check_finds_an_unbounded_wait():
    assert unbounded("ray.get(ref)\nray.get(ref, timeout=5)\nray.get(ref, 5)") == [1]
    assert unbounded("ray.wait(refs, num_returns=1)\nray.wait(refs, 1, 0)") == [1]
    assert unbounded("ray.get(x.remote(), **bounded)\nself.get(ref)") == []


def test_every_ray_get_and_wait_names_a_timeout():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line in unbounded(path.read_text())
    ]
    assert not found, found
