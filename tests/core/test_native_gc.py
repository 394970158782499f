"""The C tree and Python's garbage collector (issue #14): no C TreeNode, children dict,
key, slot or lock list, nor the tree's `by_first_key` and `roots`, is in the collector's
tracked set; a tree that goes away breaks its parent <-> children cycles itself
(nodes.unlink), so its nodes are freed by reference counting; and freeing a long chain
of nodes does not recurse once per node."""

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvfabric.core.cache import radix
from kvfabric.core.cache.layout import KVLayout
from kvfabric.core.cache.node_cache import NodeCache
from kvfabric.core.cache.pools import PoolCapacity
from kvfabric.core.cache.radix import ABSENT, RadixTree

from tests.core.test_cache_stateful import family
from tests.examples import examples

pytestmark = pytest.mark.skipif(
    not radix.ENABLED, reason="KVF_NATIVE=0 or not built: the reference alone"
)

ROOT = Path(__file__).resolve().parents[2]


def live() -> int:
    assert radix.EXT is not None
    n: int = radix.EXT.live_nodes()
    return n


def busy_cache(seeds: range, device_pages: int = 40) -> NodeCache:
    """A native cache after puts and matches of sharing sequences: splits, SWA tombstones,
    and (few pages) evictions that detach nodes."""
    layout = KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=2, page_size=2, window=2)
    caps = {p: PoolCapacity(device_pages, 8) for p in layout.pools}
    cache = NodeCache(layout, caps, store_bytes=False)
    assert cache.tree.native
    for seed in seeds:
        for seq in family(seed):
            cache.match(seq, f"ns{seed % 3}")
            cache.put(seq, None, f"ns{seed % 3}")
    return cache


def test_the_tree_stays_out_of_the_collector():
    cache = busy_cache(range(40))
    tree = cache.tree
    nodes_seen = [*tree.roots.values(), *tree.nodes()]
    assert len(nodes_seen) > 20 and any(ABSENT in (n.slots[0][1] or ()) for n in nodes_seen)
    assert any(n.children for n in nodes_seen) and len(tree.roots) == 3
    assert not gc.is_tracked(tree.by_first_key) and not gc.is_tracked(tree.roots)
    for node in nodes_seen:
        held = [node, node.children, node.keys, node.slots, node.locks, *node.slots]
        held += [pages for row in node.slots for pages in row if pages is not None]
        assert not any(gc.is_tracked(x) for x in held), node
    gc.collect()  # a collection changes none of it
    assert not gc.is_tracked(tree.by_first_key) and not any(gc.is_tracked(n) for n in nodes_seen)
    cache.check()


def test_a_dropped_tree_frees_its_nodes_without_the_collector():
    before = live()
    gc.disable()  # reference counting alone, after the tree's finalizer broke the cycles
    try:
        tree = RadixTree(2, print, print, native=True)
        parent = tree.root(b"r")
        for i in range(50):
            node = tree.attach(parent, [b"k%d" % i], i.to_bytes(2, "big"), None)
            parent = node if i % 3 else parent
        tree.split(node, 1) if node.n > 1 else None
        assert live() == before + 51
        del tree, parent, node
        assert live() == before
    finally:
        gc.enable()


def test_a_dropped_cache_frees_its_nodes():
    gc.collect()
    before = live()
    cache = busy_cache(range(10))
    assert live() > before + 10
    del cache
    gc.collect()  # the cache itself is in cycles (its tree's callbacks): the tree's finalizer
    assert live() == before


def test_nodes_held_after_the_cache_is_gone_stay_valid():
    gc.collect()
    before = live()
    cache = busy_cache(range(3), device_pages=64)
    seq = family(1)[-1]
    m = cache.match(seq, "ns1")
    assert len(m.path) >= 2
    want = [(list(n.keys), n.tokens, n.start, n.end, list(n.locks)) for n in m.path]
    del cache
    gc.collect()
    assert live() == before + len(m.path)  # the path alone: no parent chain kept alive
    for node, (keys, tokens, start, end, locks) in zip(m.path, want):
        assert node.parent is None and node.children == {} and node.is_root
        assert (node.keys, node.tokens, node.start, node.end, node.locks) == (
            keys,
            tokens,
            start,
            end,
            locks,
        )
        assert repr(node).startswith("TreeNode(")
    assert m.keys == [k for n in m.path for k in n.keys][: m.usable_pages]
    del m, node
    assert live() == before


def shaped_tree(steps: list[tuple[str, int, int]]) -> tuple[RadixTree, list]:
    """A native tree after attach (A), split (S) and detach (D) steps on its attached
    nodes (as a cache makes them), and every node made, detached ones included."""
    tree = RadixTree(2, print, print, native=True)
    made = [tree.root(b"r0"), tree.root(b"r1")]
    for i, (op, pick, k) in enumerate(steps):
        here = [tree.root(b"r%d" % (pick % 2)), *tree.nodes()]
        node = here[pick % len(here)]
        if op == "A":
            keys = [b"%d.%d" % (i, j) for j in range(k)]
            made.append(tree.attach(node, keys, i.to_bytes(2, "big") * k, None))
        elif op == "S" and 0 < k < node.n:
            made.append(tree.split(node, k))
        elif op == "D" and not node.is_root and not node.children:
            tree.detach(node, None)
    return tree, made


def kept_alive(held: list, attached: set[int]) -> dict[int, object]:
    """The held nodes and what their parent links keep once unlink took the attached ones'."""
    alive = {}
    for node in held:
        alive[id(node)] = node
        while id(node) not in attached and node.parent is not None:
            node = alive.setdefault(id(node.parent), node.parent)
    return alive


@settings(max_examples=examples(150), deadline=None)
@given(
    steps=st.lists(st.tuples(st.sampled_from("ASD"), st.integers(0, 60), st.integers(1, 3))),
    keep=st.lists(st.integers(0, 80)),
)
def test_what_a_dropped_tree_leaves_alive(steps, keep):
    """Random shapes, some nodes held past the tree: exactly the held nodes and what their
    parent links keep stay alive (a detached node keeps its parent), by reference counting
    alone; attached ones lose parent and children."""
    before = live()
    gc.disable()
    try:
        tree, made = shaped_tree(steps)
        attached = {id(n) for n in [*tree.roots.values(), *tree.nodes()]}
        alive = kept_alive([made[i % len(made)] for i in keep], attached)
        del tree, made
        assert live() == before + len(alive)
        for key in alive:
            if key in attached:
                assert alive[key].parent is None and not alive[key].children
            else:
                assert alive[key].is_root or alive[id(alive[key].parent)] is alive[key].parent
        del alive
        assert live() == before
    finally:
        gc.enable()


# Each chain is made and dropped on a thread with a small C stack: a free that recursed
# once per node would overflow it and kill the process (hence a subprocess).
DEEP = """
import threading
from kvfabric.core.cache import _radix as r
from kvfabric.core.cache.radix import RadixTree
N, out = 200_000, []

def key(i):
    return i.to_bytes(8, "little")

def up():  # each node holds its parent: freeing the leaf frees every ancestor
    node = r.TreeNode([b"r"], b"", None, 0)
    for i in range(N):
        node = r.TreeNode([key(i)], b"tt", node, i)
    del node
    out.append(r.live_nodes())

def down():  # parents hold children, which hold no parent: freeing the root frees all
    root = node = r.TreeNode([b"r"], b"", None, 0)
    for i in range(N):
        node = r.attach(node, [key(i)], b"tt", 2, {}, 0)
        node.parent = None
    del node, root
    out.append(r.live_nodes())

def tree():  # a whole tree, dropped: its finalizer unlinks it
    t = RadixTree(2, print, print, native=True)
    node = t.root(b"r")
    for i in range(N):
        node = t.attach(node, [key(i)], b"tt", None)
    del node, t
    out.append(r.live_nodes())

threading.stack_size(1 << 20)
for f in (up, down, tree):
    t = threading.Thread(target=f)
    t.start()
    t.join()
print(*out)
"""


def test_deep_chains_are_freed_without_recursion():
    env = {**os.environ, "KVF_NATIVE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", DEEP],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.split() == ["0", "0", "0"]
