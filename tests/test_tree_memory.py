"""`kvfabric bench radix`'s metadata figure counts what the tree holds for its pages."""

from kvfabric.core.cache.layout import KVLayout

from benchmarks.tree_memory import tree_bytes_per_page

LAYOUT = KVLayout(layers=("full",), kv_heads=1, head_dim=1, page_size=16)


def test_a_cached_page_costs_at_least_its_tokens_and_key():
    seqs = [list(range(i, i + 16 * 20)) for i in range(0, 4000, 400)]  # 10 prompts, 20 pages
    per_page = tree_bytes_per_page(seqs, LAYOUT, pages=400)
    # its 16 tokens as int32 (64 bytes) and its 16-byte key, plus the objects holding them
    assert 64 + 16 < per_page < 1000
