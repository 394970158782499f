"""EnginePages: what one vLLM engine's device cache holds, as fabric pages for the index.

vLLM names a block by its own chained hash; the fabric names a page by its chained
key (core/cache/keys.py: namespace-keyed, over the page's tokens and the previous key).
A BlockStored event carries each block's hash, its parent's hash and its tokens, so a
block's key follows from its parent's key and its tokens: a bounded map from vLLM hash
to page remembers the keys of blocks seen. A block whose parent is not in the map
(evicted from it, or never seen) has no key and is skipped (counted).

Namespace: vLLM puts a request's cache_salt in the first block's extra keys, and a
LoRA adapter's name in every block's; they become the namespace by the connector's own
rule (namespaces.py: the adapter named by the identity the connector read from its
files), and a child block inherits its parent's namespace. Any other extra key
(multimodal inputs, prompt embeds), or an adapter the connector has not identified, is
skipped, never keyed as plain text. Two tenants' identical prompts, or a base and an
adapter request, thus get different keys.

Mask: FULL_DEVICE when every full-attention group holds the block, SWA_DEVICE when
every sliding-window group does (their events list only in-window blocks). A page's
key comes from any group's event with its tokens, so the order of the groups' events
in a batch does not matter. This class offers what IndexLink needs of a publisher
(`drain_routed`, `snapshots`), with the same batch rules as fabric's EventPublisher:
per-shard sequences, each shard's first batch `cleared`, a restatement after a clear.

Bounded: at most `max_entries` vLLM hashes (least recently stored dropped first; a
dropped one that was published is published as gone), pages at most `max_depth` deep
(a page keeps its parent's page for routing paths: at most max_entries * max_depth
pages live, about max_entries when blocks are cached with their prefix, as in vLLM)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable

from kvfabric.core.cache.keys import KeyerCache, PageKeyer, encode_tokens
from kvfabric.core.cache.layout import KVLayout, PoolName
from kvfabric.core.index.events import EventBatch, PageMask, PageState, Snapshot
from kvfabric.core.index.routes import RouteTable
from kvfabric.core.index.shard_batches import ShardBatches
from kvfabric.deploy.serving.cache_namespace import cache_namespace

from .event_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

DEVICE_MEDIA = (
    None,
    "GPU",
)  # vLLM's own KV cache (the CPU backend's too); others are offload tiers
SPEC_KINDS = {PoolName.FULL: "full_attention", PoolName.SWA: "sliding_window"}


def group_pools_of(metadata: list[dict]) -> tuple[PoolName, ...]:
    """Each KV cache group's pool, from EngineCore's `get_kv_cache_group_metadata`
    (vLLM's own events name a group by index only)."""
    kinds = {v: k for k, v in SPEC_KINDS.items()}
    pools = []
    for i, m in enumerate(sorted(metadata, key=lambda m: m["group_idx"])):
        if m["group_idx"] != i or m["kind"] not in kinds:
            raise ValueError(
                f"KV cache group {m}: the fabric indexes full and sliding-window groups only"
            )
        pools.append(kinds[m["kind"]])
    return tuple(pools)


class Skip(Enum):
    MEDIUM = "medium"  # an offload tier's event, not the device cache
    GROUP = "group"  # no such group, or its kind disagrees with the engine's
    BLOCK_SIZE = "block_size"  # not one fabric page per block (a partial-block entry)
    EXTRA_KEYS = "extra_keys"  # LoRA, multimodal or prompt-embeds inputs
    UNKNOWN_PARENT = "unknown_parent"
    PARTIAL_RANGE = "partial_range"  # a window's blocks, before a full group's event keyed them
    TOO_DEEP = "too_deep"
    KEY_TAKEN = "key_taken"  # another vLLM hash already names this page
    UNKNOWN_REMOVED = "unknown_removed"


@dataclass
class EngineStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    dropped_entries: int = 0  # forgotten to stay within max_entries
    skipped: dict[Skip, int] = field(default_factory=lambda: {s: 0 for s in Skip})


class _Page:
    """A translated block: its key, where it sits, and its parent page (routing paths)."""

    __slots__ = ("key", "parent_key", "depth", "up", "namespace")

    def __init__(
        self, key: bytes, parent_key: bytes, depth: int, up: "_Page | None", namespace: str
    ) -> None:
        self.key, self.parent_key, self.depth, self.up, self.namespace = (
            key,
            parent_key,
            depth,
            up,
            namespace,
        )


class _Entry:
    __slots__ = ("page", "groups")

    def __init__(self) -> None:
        self.page: _Page | None = None  # None: no key known yet
        self.groups = 0  # bit g: group g holds the block


class _EventKeys:
    """The page keys of one BlockStored event's blocks: one native call chains them all,
    from the first block that needs a key, and each later block whose parent key is the
    one before it in that chain takes its key from there (keys are deterministic)."""

    __slots__ = ("raw", "keyer", "first", "parent", "keys")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.keyer: PageKeyer | None = None
        self.first, self.parent = -1, b""
        self.keys: list[bytes] = []

    def key(self, keyer: PageKeyer, block: int, parent_key: bytes) -> bytes:
        i = block - self.first
        if keyer is self.keyer and 0 <= i < len(self.keys):
            if parent_key == (self.keys[i - 1] if i else self.parent):
                return self.keys[i]
        self.keyer, self.first, self.parent = keyer, block, parent_key
        self.keys = keyer.chain(self.raw, parent_key, block)
        return self.keys[0]


class EnginePages:
    def __init__(
        self,
        node: str,
        epoch: int,
        layout: KVLayout,
        group_pools: tuple[PoolName, ...],
        max_entries: int = 1 << 17,
        max_depth: int = 1 << 14,
        pending_floor: int = 1024,
        adapters: Callable[[str], str | None] | None = None,
    ) -> None:
        """`adapters`: a LoRA adapter's identity by name (RequestNamespaces.adapter_named);
        None: blocks of adapters are skipped."""
        if not group_pools or max_entries < 1 or max_depth < 1:
            raise ValueError("an engine needs KV cache groups, max_entries >= 1 and max_depth >= 1")
        self.node, self.epoch, self.layout = node, epoch, layout
        self.fingerprint = layout.fingerprint
        self.group_pools = tuple(group_pools)
        self.max_entries, self.max_depth = max_entries, max_depth
        self._full = sum(1 << g for g, p in enumerate(group_pools) if p == PoolName.FULL)
        self._swa = sum(1 << g for g, p in enumerate(group_pools) if p == PoolName.SWA)
        self._keyers = KeyerCache(layout.fingerprint, layout.page_size)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._owner: dict[bytes, bytes] = {}  # page key -> the vLLM hash naming it
        self._changed: dict[bytes, _Page] = {}
        self._pending_limit = pending_floor + 2 * max_entries
        self._restate = True
        self.shards = ShardBatches(node, epoch, layout.fingerprint)
        self.stats = EngineStats()
        self.adapters = adapters

    # --- vLLM's events -----------------------------------------------------------------
    def apply(self, events: Iterable[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev)
            elif isinstance(ev, AllBlocksCleared):
                self.clear()
            else:
                raise TypeError(f"not a decoded KV event: {ev!r}")

    def clear(self) -> None:
        """The engine holds nothing now (AllBlocksCleared, or its events were lost): the
        keys stay known (vLLM's hashes are deterministic), the holdings go."""
        self.stats.clears += 1
        for entry in self._entries.values():
            entry.groups = 0
        self._changed.clear()
        self._restate = True

    def _stored(self, ev: BlockStored) -> None:
        group = self._group(ev.group, ev.medium, ev.spec_kind)
        if group is None:
            return
        if ev.block_size != self.layout.page_size:
            self._skip(Skip.BLOCK_SIZE, len(ev.block_hashes))
            return
        lora = None
        if ev.lora_name is not None or ev.lora_id is not None:
            lora = self.adapters(ev.lora_name) if self.adapters and ev.lora_name else None
            if lora is None:
                self._skip(Skip.EXTRA_KEYS, len(ev.block_hashes))
                return
        keys = _EventKeys(encode_tokens(ev.token_ids))
        # A group that skipped blocks of the range (out of its window) does not say which
        # tokens are whose: its blocks are held, their keys come from a full group's event.
        whole = len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
        parent_hash = ev.parent_hash
        for j, h in enumerate(ev.block_hashes):
            extra = ev.extra_keys[j] if ev.extra_keys is not None else None
            entry = self._entries.get(h)
            if entry is None:
                entry = self._entries[h] = _Entry()
            else:
                self._entries.move_to_end(h)
            if entry.page is None and whole:
                self._translate(
                    entry, h, parent_hash, _strip_adapter(extra, ev.lora_name), keys, j, lora
                )
            elif entry.page is None:
                self._skip(Skip.PARTIAL_RANGE)
            # Held even without a key yet: a later event (another group's) may bring it.
            entry.groups |= 1 << group
            if entry.page is not None:
                self.stats.stored_blocks += 1
                self._touch(entry.page)
            parent_hash = h
        self._bound()

    def _translate(
        self,
        entry: _Entry,
        h: bytes,
        parent_hash: bytes | None,
        extra: tuple | None,
        keys: _EventKeys,
        block: int,
        lora: str | None,
    ) -> bool:
        if extra is _FOREIGN:
            return self._skip(Skip.EXTRA_KEYS)
        if parent_hash is None:
            if extra is not None and not (len(extra) == 1 and type(extra[0]) is str):
                return self._skip(Skip.EXTRA_KEYS)
            namespace = cache_namespace(extra[0] if extra else None, lora)
            keyer, up = self._keyers.get(namespace), None
            parent_key, depth = keyer.root, 0
        else:
            if extra is not None:
                return self._skip(Skip.EXTRA_KEYS)
            parent = self._entries.get(parent_hash)
            up = parent.page if parent is not None else None
            if up is None:
                return self._skip(Skip.UNKNOWN_PARENT)
            if up.depth + 1 >= self.max_depth:
                return self._skip(Skip.TOO_DEEP)
            namespace, parent_key, depth = up.namespace, up.key, up.depth + 1
            keyer = self._keyers.get(namespace)
        key = keys.key(keyer, block, parent_key)
        if self._owner.setdefault(key, h) != h:
            return self._skip(Skip.KEY_TAKEN)
        entry.page = _Page(key, parent_key, depth, up, namespace)
        return True

    def _removed(self, ev: BlockRemoved) -> None:
        group = self._group(ev.group, ev.medium, None)
        if group is None:
            return
        for h in ev.block_hashes:
            entry = self._entries.get(h)
            if entry is None or not entry.groups & (1 << group):
                self._skip(Skip.UNKNOWN_REMOVED)
                continue
            self.stats.removed_blocks += 1
            entry.groups &= ~(1 << group)
            if entry.page is not None:
                self._touch(entry.page)

    def _group(self, group: int | None, medium: str | None, kind: str | None) -> int | None:
        if medium not in DEVICE_MEDIA:
            self._skip(Skip.MEDIUM)
            return None
        if group is None and len(self.group_pools) == 1:
            group = 0
        if (
            group is None
            or group >= len(self.group_pools)
            or (kind is not None and kind != SPEC_KINDS[self.group_pools[group]])
        ):
            self._skip(Skip.GROUP)
            return None
        return group

    def _skip(self, why: Skip, n: int = 1) -> bool:
        self.stats.skipped[why] += n
        return False

    def _touch(self, page: _Page) -> None:
        self._changed[page.key] = page
        if len(self._changed) > self._pending_limit:
            self._changed.clear()
            self._restate = True

    def _bound(self) -> None:
        while len(self._entries) > self.max_entries:
            h, entry = self._entries.popitem(last=False)
            if entry.page is not None:
                if self._owner.get(entry.page.key) == h:
                    del self._owner[entry.page.key]
                if entry.groups:
                    self.stats.dropped_entries += 1
                    self._touch(entry.page)

    # --- what the index is told ----------------------------------------------------------
    def mask(self, groups: int) -> int:
        full = PageMask.FULL_DEVICE if self._full and groups & self._full == self._full else 0
        swa = PageMask.SWA_DEVICE if self._swa and groups & self._swa == self._swa else 0
        return int(full | swa)

    def _state(self, page: _Page) -> PageState:
        h = self._owner.get(page.key)
        entry = self._entries.get(h) if h is not None else None
        if entry is None or entry.page is None or entry.page.key != page.key:
            return PageState(page.key, page.parent_key, page.depth, 0)
        return PageState(page.key, page.parent_key, page.depth, self.mask(entry.groups))

    def held(self) -> dict[bytes, PageState]:
        """Every page published as held, by key."""
        return {state.key: state for state in map(self._state, self._pages()) if state.mask}

    def _pages(self) -> Iterable[_Page]:
        return (e.page for e in self._entries.values() if e.page is not None and e.groups)

    def drain_routed(self, routes: RouteTable, every_shard: bool = False) -> dict[int, EventBatch]:
        """One batch per shard that must hear of a changed page (EventPublisher's rules)."""
        changed, restate = list(self._changed.values()), self._restate
        self._changed, self._restate = {}, False
        if restate:
            return self.shards.restatement(routes, self._held_paths())
        paths = _Paths()
        return self.shards.changes(
            routes, ((self._state(page), paths.of(page)) for page in changed), every_shard
        )

    def snapshots(self, routes: RouteTable) -> dict[int, Snapshot]:
        return self.shards.snapshots(routes, self._held_paths())

    def _held_paths(self):
        paths = _Paths()
        return ((self._state(page), paths.of(page)) for page in self._pages())

    def __len__(self) -> int:
        return len(self._entries)


_FOREIGN = ("foreign",)  # extra keys that name another adapter than the event's


def _strip_adapter(extra: tuple | None, lora_name: str | None) -> tuple | None:
    """A block's extra keys without the adapter's name vLLM puts first in each; _FOREIGN
    if they do not start with it."""
    if lora_name is None:
        return extra
    if not extra or extra[0] != lora_name:
        return _FOREIGN
    return extra[1:] or None


class _Paths:
    """Page keys from depth 0, memoized per page for one drain."""

    def __init__(self) -> None:
        self._memo: dict[int, list[bytes]] = {}

    def of(self, page: _Page) -> list[bytes]:
        above: list[_Page] = []
        p: _Page | None = page
        while p is not None and id(p) not in self._memo:
            above.append(p)
            p = p.up
        path = [] if p is None else self._memo[id(p)]
        for q in reversed(above):
            path = self._memo[id(q)] = path + [q.key]
        return path
