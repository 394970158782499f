import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvfabric.core.cache.allocator import AllocatorError, OutOfPages, PageAllocator
from kvfabric.core.cache.keys import PageKeyer
from kvfabric.core.cache.layout import KVLayout, LayoutError, PoolName

LAYOUT = KVLayout(layers=("full", "swa", "full"), kv_heads=2, head_dim=8, page_size=4, window=6)


def test_layout_geometry():
    assert LAYOUT.pools == (PoolName.FULL, PoolName.SWA)
    assert LAYOUT.layers_of(PoolName.FULL) == (0, 2)
    assert LAYOUT.page_shape(PoolName.SWA) == (1, 2, 4, 2, 8)
    assert LAYOUT.page_bytes(PoolName.FULL) == 2 * 2 * 4 * 2 * 8 * 4
    assert LAYOUT.window_pages == 2  # 6 tokens need 2 pages of 4
    assert KVLayout.from_dict(LAYOUT.to_dict()) == LAYOUT
    other = KVLayout(layers=("full", "swa", "full"), kv_heads=2, head_dim=8, page_size=4, window=8)
    assert other.fingerprint != LAYOUT.fingerprint


@pytest.mark.parametrize(
    "dtype", ["float32", "float16", "bfloat16", "uint8", "float8_e4m3fn", "float8_e5m2"]
)
def test_a_page_is_as_many_bytes_as_its_tensor(dtype):
    """The layout sizes pages without torch (the index's processes never import it): its
    size per element must be torch's for the dtype it names."""
    import torch

    layout = KVLayout(
        layers=("full", "swa"), kv_heads=2, head_dim=8, page_size=4, window=4, dtype=dtype
    )
    assert layout.torch_dtype == getattr(torch, dtype)
    for pool in layout.pools:
        page = torch.empty(layout.page_shape(pool), dtype=layout.torch_dtype)
        assert layout.page_bytes(pool) == page.nbytes


@pytest.mark.parametrize(
    "bad",
    [
        dict(layers=()),
        dict(kv_heads=0),
        dict(head_dim=-1),
        dict(page_size=True),
        dict(window=0),
        dict(dtype="int8"),
        dict(layers=("full", "moe")),
    ],
)
def test_layout_rejects_bad_fields(bad):
    fields = dict(layers=("full", "swa"), kv_heads=1, head_dim=4, page_size=4, window=4) | bad
    with pytest.raises((LayoutError, ValueError)):
        KVLayout(**fields)


def test_layout_from_dict_rejects_unknown_and_missing():
    with pytest.raises(LayoutError, match="unknown"):
        KVLayout.from_dict(LAYOUT.to_dict() | {"extra": 1})
    with pytest.raises(LayoutError):
        KVLayout.from_dict({"layers": ["full"]})
    with pytest.raises(LayoutError, match="no SWA"):
        KVLayout(layers=("full",), kv_heads=1, head_dim=4, page_size=4, window=4)


def test_keys_chain_and_isolate_namespaces():
    a = PageKeyer("tenant-a", LAYOUT.fingerprint, 4)
    b = PageKeyer("tenant-b", LAYOUT.fingerprint, 4)
    tokens = list(range(19))
    ka = a.keys(tokens)
    assert len(ka) == 4  # partial page has no key
    assert a.keys(tokens[:8]) == ka[:2]  # keys of a prefix are a prefix
    assert set(ka).isdisjoint(b.keys(tokens))  # tenants never share keys
    assert a.keys([0, 1, 2, 9] + tokens[4:])[1:] != ka[1:]  # a key names the whole prefix
    assert a.keys(tokens[4:8], start_key=ka[0]) == [ka[1]]
    other_layout = PageKeyer("tenant-a", b"x" * 16, 4)
    assert set(other_layout.keys(tokens)).isdisjoint(ka)


@given(st.lists(st.integers(0, 2**31 - 1), max_size=64), st.integers(1, 8))
def test_keys_are_prefix_consistent(tokens, page):
    k = PageKeyer("ns", b"f" * 16, page)
    keys = k.keys(tokens)
    assert len(keys) == len(tokens) // page
    for cut in range(0, len(tokens) + 1, page):
        assert k.keys(tokens[:cut]) == keys[: cut // page]


def test_keys_reject_bad_input():
    with pytest.raises(ValueError):
        PageKeyer("", b"f" * 16, 4)
    k = PageKeyer("ns", b"f" * 16, 4)
    with pytest.raises(ValueError):
        k.keys([1, 2, "x", 4])
    with pytest.raises(ValueError):
        k.keys([2**40, 1, 2, 3])


def test_allocator_detects_misuse():
    a = PageAllocator(4)
    got = a.alloc(3)
    assert got == [0, 1, 2]  # fresh allocators give contiguous runs
    with pytest.raises(OutOfPages):
        a.alloc(2)
    a.free([1])
    with pytest.raises(AllocatorError, match="already free"):
        a.free([1])
    with pytest.raises(AllocatorError, match="not in this allocator"):
        a.free([7])
    with pytest.raises(AllocatorError):
        a.free([0, 0])
    with pytest.raises(AllocatorError, match="in use"):
        a.take([0])
    a.take([1])
    assert a.used_count == 3 and a.free_count == 1


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(12)
        self.used: set[int] = set()

    @rule(n=st.integers(0, 5))
    def alloc_pages(self, n):
        if n > 12 - len(self.used):
            with pytest.raises(OutOfPages):
                self.alloc.alloc(n)
            return
        got = self.alloc.alloc(n)
        assert len(set(got)) == n and not set(got) & self.used
        self.used |= set(got)

    @precondition(lambda self: self.used)
    @rule(data=st.data())
    def free_some(self, data):
        pick = data.draw(st.lists(st.sampled_from(sorted(self.used)), unique=True, min_size=1))
        self.alloc.free(pick)
        self.used -= set(pick)

    @rule(i=st.integers(-2, 14))
    def misuse_changes_nothing(self, i):
        before = self.alloc.used_indices()
        op = self.alloc.free if i not in self.used else self.alloc.take
        with pytest.raises(AllocatorError):
            op([i])
        assert self.alloc.used_indices() == before

    @invariant()
    def counts_agree(self):
        assert self.alloc.used_indices() == self.used
        assert self.alloc.free_count + self.alloc.used_count == 12


TestAllocatorMachine = AllocatorMachine.TestCase
