"""The index core's two presence tables, C and pure Python, driven through the same random
sequences of every PrefixIndex operation: equal results for every call, equal state after
each (node_pages, held_keys in order, page_meta, sync points, stats, len, every key's
packed codes, and its form: pairs or bitset). Many nodes (over 8 slots, a word of codes, and over
SPARSE_MAX holders a key: keys switch between pairs and bitset both ways, at the
boundary), drops and slot reuse, random MatchRules. The existing index tests run on
both cores through KVF_NATIVE."""

import gc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfabric.core.index import presence
from kvfabric.core.index.events import MAX_DEPTH, EventBatch, EventError, PageState, Snapshot
from kvfabric.core.index.match_rule import MatchRule
from kvfabric.core.index.prefix_index import PrefixIndex

from tests.examples import examples

pytestmark = pytest.mark.skipif(
    not presence.ENABLED, reason="KVF_NATIVE=0 or not built: the reference alone"
)

# Keys that differ in one byte (the table must not rely on keys being hashes) and a root.
KEYS = [i.to_bytes(16, "big") for i in range(1, 25)]
ROOT = b"\xff" * 16
NAMES = [f"n{i}" for i in range(40)]

rules = (
    st.tuples(st.integers(0, 4), st.booleans())
    .filter(lambda t: t[0] or t[1])
    .map(lambda t: MatchRule(*t))
)
runs = st.tuples(st.integers(0, len(KEYS) - 1), st.integers(1, 8)).map(
    lambda t: KEYS[t[0] : t[0] + t[1]]
)


def pages(data, allow_zero: bool) -> tuple[PageState, ...]:
    run = data.draw(runs)
    first = data.draw(st.integers(0, 3))
    low = 0 if allow_zero else 1
    one = data.draw(st.integers(low, 63)) if data.draw(st.booleans()) else None  # one chain
    return tuple(
        PageState(
            k,
            run[i - 1] if i and data.draw(st.integers(0, 5)) else ROOT,  # breaks in the chain
            first + i + (0 if data.draw(st.integers(0, 5)) else 1),
            one if one is not None else data.draw(st.integers(low, 63)),
        )
        for i, k in enumerate(run)
    )


def call(ix: PrefixIndex, op: str, args: tuple):
    try:
        return getattr(ix, op)(*args)
    except (EventError, ValueError) as e:
        return type(e), str(e)


def state(ix: PrefixIndex) -> tuple:
    nodes = sorted(set(ix.nodes()) | set(NAMES[:5]))
    return (
        ix.held_keys(),
        len(ix),
        ix.stats(),
        ix.nodes(),
        [(n, ix.node_pages(n), ix.sync_point(n)) for n in nodes],
        [ix.page_meta(k) for k in KEYS],
        [ix._presence.get(k) for k in KEYS],
        [ix._presence.dense(k) for k in KEYS],
    )


def next_seq(ix: PrefixIndex, node: str, data) -> tuple[int, int]:
    sync = ix.sync_point(node)
    epoch, seq = (1, -1) if sync is None else (sync[0], -1 if sync[1] is None else sync[1])
    return epoch + data.draw(st.sampled_from([0, 0, 0, 1, -1])), max(
        0, seq + data.draw(st.sampled_from([1, 1, 1, 0, 2]))
    )


def draw_op(data, ix: PrefixIndex, nodes: int) -> tuple[str, tuple]:
    node = data.draw(st.sampled_from(NAMES[:nodes]))
    kind = data.draw(
        st.sampled_from(
            [
                "chain",
                "chain",
                "chain",
                "apply",
                "snapshot",
                "drop",
                "admit",
                "lookup",
                "lookup",
                "lookup",
                "bad",
            ]
        )
    )
    epoch, seq = next_seq(ix, node, data)
    if kind == "chain":
        run = data.draw(runs)
        return "apply_chain", (
            node,
            epoch,
            seq,
            run,
            data.draw(st.sampled_from([0, 1, 2, 3, MAX_DEPTH - 8])),
            ROOT,
            data.draw(st.sampled_from([0, 1, 2, 3, 4, 5, 12, 15, 16, 48, 19, 63])),
            data.draw(st.booleans()),
        )
    if kind == "apply":
        return "apply", (EventBatch(node, epoch, seq, pages(data, True), data.draw(st.booleans())),)
    if kind == "snapshot":
        return "load_snapshot", (Snapshot(node, epoch, seq, pages(data, False)),)
    if kind == "drop":
        return "drop_node", (node,)
    if kind == "admit":
        return "admit", (node, epoch)
    if kind == "bad":
        return data.draw(
            st.sampled_from(
                [
                    ("lookup", ([KEYS[0], b"short"],)),
                    ("lookup", ([KEYS[0], 7],)),
                    ("apply_chain", (node, epoch, seq, [KEYS[0], b"x"], 0, ROOT, 3)),
                    ("apply_chain", (node, epoch, seq, KEYS[:2], 0, ROOT, 64)),
                    ("apply_chain", (node, epoch, seq, KEYS[:2], 0, b"x" * 16, 3)),
                    ("apply_chain", (node, epoch, seq, KEYS[:2], MAX_DEPTH - 1, ROOT, 3)),
                    ("apply_chain", (node, epoch, seq, KEYS[:2], -1, ROOT, 3)),
                    (
                        "apply",
                        (EventBatch(node, epoch, seq, (PageState(KEYS[0], ROOT, MAX_DEPTH, 3),)),),
                    ),
                    (
                        "load_snapshot",
                        (Snapshot(node, epoch, seq, (PageState(KEYS[0], ROOT, 0, 0),)),),
                    ),
                ]
            )
        )
    keys = (
        list(data.draw(runs))
        if data.draw(st.booleans())
        else KEYS[: data.draw(st.integers(0, len(KEYS)))]
    )
    if keys and data.draw(st.booleans()):  # a hole: a key no node holds
        keys[data.draw(st.integers(0, len(keys) - 1))] = b"\x00" * 16
    return "lookup", (keys,)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rule=rules, nodes=st.integers(1, 40), data=st.data())
def test_native_and_python_cores_agree(rule, nodes, data):
    py, c = PrefixIndex(rule, native=False), PrefixIndex(rule, native=True)
    assert type(py._presence) is presence.Presence and type(c._presence) is presence.EXT.Presence
    for i, name in enumerate(NAMES[:nodes]):  # every node holds something: up to 40 slots
        args = (name, 1, 0, KEYS[i % 20 : i % 20 + 1 + i % 5], i % 20, ROOT, 1 + i % 15, True)
        assert py.apply_chain(*args) is c.apply_chain(*args)
    for _ in range(data.draw(st.integers(1, 40))):
        op, args = draw_op(data, py, nodes)
        before = state(c)
        result = call(py, op, args)
        assert result == call(c, op, args), (op, args)
        after = state(c)
        assert state(py) == after, (op, args)
        if isinstance(result, tuple):  # refused: nothing changed, on either core
            assert after == before, (op, args)
        for keys in (KEYS, KEYS[3:], KEYS[:1]):
            assert py.lookup(keys) == c.lookup(keys)


def test_native_table_not_gc_tracked_and_sized():
    table = presence.EXT.Presence(2, True)
    assert not gc.is_tracked(table)
    table.open(0)
    table.set_chain(0, KEYS, 0, ROOT, 3)
    assert len(table) == len(KEYS) and table.count(0) == len(KEYS)
    assert table.__sizeof__() >= len(KEYS) * (2 * 16 + 8 + 16 + 8)  # keys, records


def table_state(table) -> tuple:
    return (
        table.keys(),
        [table.get(k) for k in KEYS],
        [table.dense(k) for k in KEYS],
        [table.meta(k) for k in KEYS],
        [(table.pages(s), table.count(s)) for s in (0, 3, 70)],
    )


def test_native_table_refuses_bad_input_and_changes_nothing():
    table = presence.EXT.Presence(0, True)
    for s in (0, 3, 70):
        table.open(s)
    table.set_chain(0, KEYS[:3], 5, ROOT, 3)
    before = table_state(table)
    for args, match in [
        ((16, KEYS, 0, ROOT, 3), "not open"),
        ((-1, KEYS, 0, ROOT, 3), "not open"),
        ((True, KEYS, 0, ROOT, 3), "not open"),
        ((0, KEYS, 0, ROOT, 64), "mask"),
        ((0, KEYS, 0, ROOT, True), "mask"),
        ((0, KEYS, -1, ROOT, 3), "first_depth"),
        ((0, KEYS, (1 << 64) - len(KEYS) + 1, ROOT, 3), "first_depth"),
        ((0, KEYS, 1 << 70, ROOT, 3), "first_depth"),
        ((0, KEYS, 2.0, ROOT, 3), "first_depth"),
        ((0, KEYS, 0, ROOT[:15], 3), "parent"),
        ((0, KEYS, 0, bytearray(ROOT), 3), "parent"),
        ((0, [KEYS[5], b"short"], 0, ROOT, 3), "16-byte"),
        ((0, [KEYS[5], bytearray(16)], 0, ROOT, 3), "16-byte"),
    ]:
        with pytest.raises(ValueError, match=match):
            table.set_chain(*args)
    with pytest.raises(TypeError):
        table.set_chain(0, 5, 0, ROOT, 3)
    with pytest.raises(TypeError):
        table.set_chain(0, KEYS, 0, ROOT)
    for bad in (b"short", "x" * 16):
        with pytest.raises(ValueError, match="16-byte"):
            table.lookup([KEYS[0], bad])
        with pytest.raises(ValueError, match="16-byte"):
            table.meta(bad)
    for call in (table.clear, table.pages, table.count, table.close):
        with pytest.raises(ValueError, match="not open"):
            call(5)
    for slot in (-1, 1 << 16, 2.0):
        with pytest.raises(ValueError, match="slot"):
            table.open(slot)
    assert table_state(table) == before
    with pytest.raises(ValueError):
        presence.EXT.Presence(-1, True)


@pytest.mark.parametrize("make", [presence.Presence, lambda w, f: presence.EXT.Presence(w, f)])
def test_table_check_is_the_same_on_both_cores(make):
    table = make(0, True)
    assert table.check(KEYS, ROOT) is None and table.check([], ROOT) is None
    for keys, parent, msg in [
        ([KEYS[0], b"x"], ROOT, "chain keys must be 16-byte bytes"),
        ([KEYS[0], bytearray(16)], ROOT, "chain keys must be 16-byte bytes"),
        (KEYS, b"x", "chain parent must be 16 bytes"),
        ([], "x" * 16, "chain parent must be 16 bytes"),
    ]:
        with pytest.raises(ValueError) as e:
            table.check(keys, parent)
        assert str(e.value) == msg


def test_native_table_grows_slots_and_keeps_order_through_compaction():
    py, c = presence.Presence(1, True), presence.EXT.Presence(1, True)
    for table in (py, c):
        table.open(70)  # nine words of codes
        table.open(3)
        for round_ in range(50):  # inserts and deletes: compactions and regrowth
            table.set_chain(70, KEYS[round_ % 24 :], round_, ROOT, 15)
            table.set_chain(3, KEYS[: round_ % 24], 0, KEYS[-1], 5)
            table.set_chain(70, KEYS[(round_ * 7) % 24 : (round_ * 7) % 24 + 9], 0, ROOT, 0)
            if round_ % 11 == 10:
                table.clear(3)
    assert c.keys() == py.keys() and [c.get(k) for k in KEYS] == [py.get(k) for k in KEYS]
    assert [c.meta(k) for k in KEYS] == [py.meta(k) for k in KEYS]
    assert all(c.pages(s) == py.pages(s) and c.count(s) == py.count(s) for s in (3, 70))
    assert sorted(c.lookup(KEYS)) == sorted(py.lookup(KEYS))
    assert c.get(KEYS[-1]) >> 560 == 63 or c.get(KEYS[-1]) == 0  # slot 70: bits 560-567
    for table in (py, c):
        table.close(70)
    assert c.keys() == py.keys() and c.pages(3) == py.pages(3)


def table_ops(slots: int):
    slot = st.integers(0, slots - 1)
    run = st.tuples(runs, st.booleans()).map(lambda t: t[0][::-1] if t[1] else t[0])
    return st.lists(
        st.one_of(
            st.tuples(st.just("open"), slot),
            st.tuples(st.just("close"), slot),
            st.tuples(st.just("clear"), slot),
            st.tuples(
                st.just("set_chain"),
                slot,
                run,
                st.sampled_from([0, 5, MAX_DEPTH - 9]),
                st.sampled_from([ROOT, KEYS[0]]),
                st.sampled_from([0, 0, 1, 2, 3, 6, 15, 16, 40, 63]),
            ),
            st.tuples(st.just("lookup"), run),
        ),
        max_size=60,
    )


def table_call(table, op: tuple):
    try:
        return getattr(table, op[0])(*op[1:])
    except ValueError as e:
        return ValueError, str(e)


@settings(max_examples=examples(200), deadline=None)
@given(rule=rules, slots=st.integers(1, 40), ops=st.data())
def test_native_and_python_tables_agree(rule, slots, ops):
    """The tables alone, driven by any sequence of their calls (closed slots included):
    the same results and errors, and the same state after each call."""
    py = presence.Presence(rule.window_pages, rule.has_full)
    c = presence.EXT.Presence(rule.window_pages, rule.has_full)
    for s in range(0, slots, 2):  # most calls land on open slots; close and open change that
        py.open(s)
        c.open(s)
    for op in ops.draw(table_ops(slots)):
        got = table_call(c, op)
        want = table_call(py, op)
        if op[0] == "lookup":
            got, want = sorted(got), sorted(want)
        assert got == want, op
        assert c.keys() == py.keys() and len(c) == len(py), op
        assert [c.get(k) for k in KEYS] == [py.get(k) for k in KEYS], op
        assert [c.dense(k) for k in KEYS] == [py.dense(k) for k in KEYS], op
        assert [c.meta(k) for k in KEYS] == [py.meta(k) for k in KEYS], op
        for s in range(slots):
            assert table_call(c, ("pages", s)) == table_call(py, ("pages", s)), (op, s)
            assert table_call(c, ("count", s)) == table_call(py, ("count", s)), (op, s)


def test_the_sparse_and_dense_bounds_are_the_same_on_both_cores():
    assert (presence.EXT.SPARSE_MAX, presence.EXT.SPARSE_BACK) == (
        presence.SPARSE_MAX,
        presence.SPARSE_BACK,
    )
    assert presence.SPARSE_BACK < presence.SPARSE_MAX


def holders(table, key: bytes) -> int:
    bits = table.get(key)
    return sum(1 for s in range(0, bits.bit_length(), 8) if bits >> s & 255)


@settings(max_examples=examples(150), deadline=None)
@given(
    rule=rules,
    slots=st.lists(st.integers(0, 5000), min_size=1, max_size=12, unique=True),
    data=st.data(),
)
def test_keys_switch_forms_at_the_bounds_alike(rule, slots, data):
    """Slots, near and far apart (past one word and past SPARSE_MAX of them), join and
    leave a few keys one at a time: both cores answer alike after each step, and a key
    is dense exactly when the rule says: past SPARSE_MAX holders, until SPARSE_BACK."""
    py = presence.Presence(rule.window_pages, rule.has_full)
    c = presence.EXT.Presence(rule.window_pages, rule.has_full)
    for table in (py, c):
        for s in slots:
            table.open(s)
    keys, dense = KEYS[:3], dict.fromkeys(KEYS[:3], False)
    seen = set()
    for _ in range(data.draw(st.integers(1, 60))):
        slot = data.draw(st.sampled_from(slots))
        first = data.draw(st.integers(0, 2))
        run = keys[first : first + data.draw(st.integers(1, 3))]
        mask = data.draw(st.sampled_from([0, 0, 1, 3, 5, 12, 15, 16, 32, 50]))
        for table in (py, c):
            table.set_chain(slot, run, first, ROOT, mask)
        for k in keys:
            n = holders(py, k)
            dense[k] = n > presence.SPARSE_MAX or (dense[k] and n > presence.SPARSE_BACK)
            assert py.dense(k) == c.dense(k) == dense[k], (k, n)
            assert py.get(k) == c.get(k)
            seen.add((n, dense[k]))
        assert c.keys() == py.keys()
        for lookup in (keys, keys[1:], keys[::-1]):
            assert sorted(c.lookup(lookup)) == sorted(py.lookup(lookup))
        assert all(c.pages(s) == py.pages(s) for s in slots)
    for table in (py, c):  # closing every slot empties every form
        for s in slots:
            table.close(s)
        assert not table.keys() and not table.dense(KEYS[0])


def test_a_key_crosses_each_bound_both_ways():
    """One key, slots 0, 17, 300, .. joining then leaving: dense from SPARSE_MAX + 1
    holders, still dense down to SPARSE_BACK + 1, pairs again at SPARSE_BACK; the same
    holders and lookups on both cores at every count."""
    slots = [0, 17, 300, 4095, 40, 2, 65535, 1000]
    py, c = presence.Presence(0, True), presence.EXT.Presence(0, True)
    for table in (py, c):
        for s in slots:
            table.open(s)
    forms = []
    for s in slots:
        for table in (py, c):
            table.set_chain(s, KEYS[:2], 0, ROOT, 1 + s % 15)
        assert py.get(KEYS[0]) == c.get(KEYS[0]) and py.dense(KEYS[0]) == c.dense(KEYS[0])
        assert sorted(py.lookup(KEYS[:2])) == sorted(c.lookup(KEYS[:2]))
        forms.append(c.dense(KEYS[0]))
    for s in slots[:-1]:
        for table in (py, c):
            table.set_chain(s, KEYS[:1], 0, ROOT, 0)
        assert py.get(KEYS[0]) == c.get(KEYS[0]) and py.dense(KEYS[0]) == c.dense(KEYS[0])
        assert sorted(py.lookup(KEYS[:2])) == sorted(c.lookup(KEYS[:2]))
        forms.append(c.dense(KEYS[0]))
    # holders 1..8 joining, then 7..1 leaving
    assert forms == [False] * 5 + [True] * 3 + [True] * 4 + [False] * 3
    assert c.get(KEYS[0]) == py.get(KEYS[0]) == presence.code(1 + 1000 % 15) << 8 * 1000
    assert c.dense(KEYS[1]) and py.dense(KEYS[1])  # the other key kept all 8


@pytest.mark.parametrize(
    "args",
    [
        (0, [KEYS[0], b"x"], 0, ROOT, 3),
        (0, [KEYS[0], "x" * 16], 0, ROOT, 3),
        (0, KEYS[:2], -1, ROOT, 3),
        (0, KEYS[:2], True, ROOT, 3),
        (0, KEYS[:2], 1.0, ROOT, 3),
        (0, KEYS[:2], MAX_DEPTH - 1, ROOT, 3),
        (0, [], MAX_DEPTH, ROOT, 3),
        (0, KEYS[:2], 0, b"x" * 15, 3),
        (0, KEYS[:2], 0, bytearray(16), 3),
        (0, KEYS[:2], 0, ROOT, 64),
        (0, KEYS[:2], 0, ROOT, True),
        (0, KEYS[:2], 0, ROOT, presence.PageMask.FULL_DEVICE),
        (1, KEYS[:2], 0, ROOT, 3),
    ],
)
def test_set_chain_checks_alike(args):
    """Both tables check every set_chain argument themselves, exact types, with the same
    messages, and change nothing (PrefixIndex's fast path relies on it)."""
    tables = [presence.new_presence(MatchRule(1), native) for native in (False, True)]
    for t in tables:
        t.open(0)
        t.set_chain(0, KEYS[:3], 0, ROOT, 3)
    errors = []
    for t in tables:
        with pytest.raises(ValueError) as e:
            t.set_chain(*args)
        errors.append(str(e.value))
        assert t.pages(0) == [
            (k, p, d, 3) for k, p, d in zip(KEYS[:3], [ROOT] + KEYS[:2], range(3))
        ]
    assert errors[0] == errors[1]
    for t in tables:  # the edges that fit
        t.set_chain(0, [], MAX_DEPTH - 1, ROOT, 0)
        t.set_chain(0, KEYS[5:7], MAX_DEPTH - 2, ROOT, 15)
    assert tables[0].pages(0) == tables[1].pages(0)
