"""The disk journal: replay is the model of the records appended, under compaction, a
crash at any byte, corruption anywhere, and another KV identity."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.cache.disk_journal import JOURNAL, DiskJournal, Drop, replay
from kvfabric.core.cache.disk_records import (
    Free,
    Header,
    PageMeta,
    Put,
    Record,
    decode,
    encode,
    read_frame,
)
from kvfabric.core.cache.layout import KVLayout, PoolName

LAYOUT = KVLayout(layers=("full", "swa"), kv_heads=1, head_dim=2, page_size=2, window=4)
CAPACITY = {PoolName.FULL: 6, PoolName.SWA: 3}


def put(pool: PoolName, slot: int, n: int) -> Put:
    meta = PageMeta(bytes([n % 3]) * 16, n, n.to_bytes(16, "little"), n.to_bytes(8, "little"))
    return Put(pool, slot, meta, (n * 7).to_bytes(16, "little"))


# An op: ("put", pool, slot), ("free", pool, slot) or ("compact",).
slot_op = st.tuples(
    st.sampled_from(["put", "put", "free"]), st.sampled_from(list(PoolName)), st.integers(0, 5)
)
ops = st.lists(st.one_of(slot_op, st.just(("compact",))), max_size=40)


def apply(model: dict, record: Record) -> None:
    if isinstance(record, Put):
        model[(record.pool, record.slot)] = record
    else:
        model.pop((record.pool, record.slot), None)


def run(tmp_path, todo, *, compact_min: int = 2) -> tuple[DiskJournal, dict, list[Record]]:
    """Apply `todo` one record per append; (journal, model, the file's records in order)."""
    journal = DiskJournal(tmp_path, LAYOUT, CAPACITY, compact_factor=1.0, compact_min=compact_min)
    model: dict = {}
    in_file: list[Record] = []
    for n, op in enumerate(todo):
        if op[0] == "compact":
            journal.compact()
        else:
            kind, pool, slot = op
            slot %= CAPACITY[pool]
            record = put(pool, slot, n) if kind == "put" else Free(pool, slot)
            before = journal._records
            journal.append([record])
            apply(model, record)
            in_file.append(record)
            if journal._records <= before:  # compacted: the file holds the live set
                in_file = list(journal.live.values())
        if op[0] == "compact":
            in_file = list(journal.live.values())
        assert journal.live == model
    return journal, model, in_file


@given(todo=ops)
def test_replay_is_the_model_of_the_records(tmp_path_factory, todo):
    folder = tmp_path_factory.mktemp("j")
    journal, model, _ = run(folder, todo)
    journal.close()
    found = replay((folder / JOURNAL).read_bytes(), LAYOUT, CAPACITY)
    assert found.live == model and not found.dropped
    again = DiskJournal(folder, LAYOUT, CAPACITY)
    assert again.live == model and again.found.live == model
    again.close()


@given(todo=ops, cut=st.floats(0, 1))
def test_a_crash_at_any_byte_keeps_the_records_written_before_it(tmp_path_factory, todo, cut):
    folder = tmp_path_factory.mktemp("j")
    journal, _, in_file = run(folder, todo)
    journal.close()
    data = (folder / JOURNAL).read_bytes()
    at = int(cut * len(data))
    expected: dict = {}
    end = len(Header.of(LAYOUT).encode())
    boundaries = {0, end}
    for record in in_file:
        end += len(encode(record))
        boundaries.add(end)
        if end <= at:
            apply(expected, record)
    assert end == len(data)
    (folder / JOURNAL).write_bytes(data[:at])
    reopened = DiskJournal(folder, LAYOUT, CAPACITY)
    assert reopened.live == expected
    torn = at not in boundaries
    assert reopened.found.dropped == (Counter({Drop.TORN_TAIL: 1}) if torn else Counter())
    # The torn tail is cut off: appends after it replay.
    reopened.append([put(PoolName.FULL, 0, 99)])
    reopened.close()
    apply(expected, put(PoolName.FULL, 0, 99))
    assert replay((folder / JOURNAL).read_bytes(), LAYOUT, CAPACITY).live == expected


@given(todo=ops, hits=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1))
def test_corruption_never_raises_nor_forges_a_record(tmp_path_factory, todo, hits):
    folder = tmp_path_factory.mktemp("j")
    journal, _, _ = run(folder, todo, compact_min=10**6)
    journal.close()
    data = bytearray((folder / JOURNAL).read_bytes())
    for where, value in hits:
        data[min(int(where * len(data)), len(data) - 1)] = value
    found = replay(bytes(data), LAYOUT, CAPACITY)  # never raises
    appended = {r for r in _records_of(todo) if isinstance(r, Put)}
    assert set(found.live.values()) <= appended


def _records_of(todo) -> list[Record]:
    out: list[Record] = []
    for n, op in enumerate(todo):
        if op[0] != "compact":
            kind, pool, slot = op
            slot %= CAPACITY[pool]
            out.append(put(pool, slot, n) if kind == "put" else Free(pool, slot))
    return out


def test_another_identity_drops_everything_and_starts_afresh(tmp_path):
    journal = DiskJournal(tmp_path, LAYOUT, CAPACITY)
    journal.append([put(PoolName.FULL, 1, 1), put(PoolName.SWA, 2, 2)])
    journal.close()
    other = KVLayout(
        layers=("full", "swa"), kv_heads=1, head_dim=2, page_size=2, window=4, tag="model=b"
    )
    reopened = DiskJournal(tmp_path, other, CAPACITY)
    assert reopened.live == {} and reopened.found.dropped == Counter({Drop.IDENTITY: 2})
    assert reopened.found.identity == ["tag model: None vs 'b'"]
    reopened.close()
    # The folder now carries the new identity, and nothing of the old.
    back = DiskJournal(tmp_path, LAYOUT, CAPACITY)
    assert back.live == {} and back.found.dropped[Drop.IDENTITY] == 0
    assert back.found.identity and "tag model" in back.found.identity[0]
    back.close()


def test_records_outside_the_capacity_are_dropped(tmp_path):
    journal = DiskJournal(tmp_path, LAYOUT, CAPACITY)
    journal.append([put(PoolName.FULL, 5, 1), put(PoolName.FULL, 1, 2)])
    journal.close()
    smaller = DiskJournal(tmp_path, LAYOUT, {PoolName.FULL: 4})
    assert list(smaller.live) == [(PoolName.FULL, 1)]
    assert smaller.found.dropped == Counter({Drop.SLOT_RANGE: 1})
    smaller.close()


def test_compaction_keeps_the_journal_small(tmp_path):
    journal = DiskJournal(tmp_path, LAYOUT, CAPACITY, compact_factor=2.0, compact_min=8)
    for n in range(200):
        journal.append([put(PoolName.FULL, n % 2, n)])
    assert journal.dead <= 8
    size = (tmp_path / JOURNAL).stat().st_size
    assert size < len(Header.of(LAYOUT).encode()) + 12 * len(encode(put(PoolName.FULL, 0, 0)))
    journal.close()
    assert not (tmp_path / "journal.tmp").exists()


def test_frames_decode_what_was_encoded():
    for record in (put(PoolName.SWA, 2, 5), Free(PoolName.FULL, 3)):
        data = memoryview(encode(record))
        state, body, end = read_frame(data, 0)
        assert end == len(data) and decode(body) == record
