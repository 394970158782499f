"""The house's layers, read from the sources: every import runs down a layer or stays in
its own, no two modules import each other (directly or round a circle), and nothing but
the chaos harness and the CLI above it imports the chaos harness. Imports for type checking
and imports inside functions count: a module that needs its host's type to compile is
as tied to it as one that calls it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The folders the wheel installs under `kvfabric` (pyproject.toml's package-dir).
FOLDERS = {"core": "kvfabric.core", "transport": "kvfabric.transport"}
FOLDERS |= {"actors": "kvfabric.actors", "deploy": "kvfabric.deploy", "kvfabric": "kvfabric"}

# Bottom first. A module belongs to the longest name here that it is or lies under; it
# may import its own layer's modules and any layer below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvfabric._version", "kvfabric._lazy", "kvfabric.core.wire", "kvfabric.core.cache"),
    ("kvfabric.core.exchange", "kvfabric.core.index"),
    ("kvfabric.core",),
    ("kvfabric.transport",),
    ("kvfabric.actors",),
    ("kvfabric.deploy.placement", "kvfabric.deploy.stats", "kvfabric.deploy.sim"),
    ("kvfabric.deploy.serving",),  # what both apps share
    ("kvfabric.deploy.reference", "kvfabric.deploy.vllm"),  # the two apps, the connector
    ("kvfabric.deploy.harness",),  # embedded clusters, HTTP replay, plots
    ("kvfabric.deploy.chaos", "kvfabric.deploy.demo"),
    ("kvfabric.deploy.cli", "kvfabric.deploy"),
    ("kvfabric",),
)
CHAOS = "kvfabric.deploy.chaos"
MAY_IMPORT_CHAOS = (CHAOS, "kvfabric.deploy.cli")


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from pkg import mod` imports the module mod; `from mod import name` mod.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a module a.b.c
                target = target.rpartition(".")[0]
            if target.startswith("kvfabric") and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(name: str) -> int:
    best, at = "", -1
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, at = prefix, i
    assert at >= 0, f"{name} is in no layer: add it to LAYERS"
    return at


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            step = next(todo, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(edges[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    part.append(top)
                    if top == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_every_module_is_in_a_layer():
    for name in graph():
        layer(name)


def test_no_two_modules_import_each_other():
    found = circles(graph())
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_imports_run_down():
    up = [f"{a} -> {b}" for a, outs in graph().items() for b in sorted(outs) if layer(b) > layer(a)]
    assert not up, "\n".join(up)


def test_production_imports_nothing_of_the_chaos_harness():
    bad = [
        f"{a} -> {b}"
        for a, outs in graph().items()
        for b in sorted(outs)
        if (b == CHAOS or b.startswith(CHAOS + "."))
        and not any(a == m or a.startswith(m + ".") for m in MAY_IMPORT_CHAOS)
    ]
    assert not bad, "\n".join(bad)


def test_the_checks_catch_a_circle_and_an_upward_import():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("kvfabric.core.cache.radix") < layer("kvfabric.transport.base")
    assert layer("kvfabric.deploy.cli.main") > layer("kvfabric.deploy.chaos.run")
