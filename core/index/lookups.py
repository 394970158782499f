"""The prefix index's lookups on the pure-Python presence table: each node slot's usable
match for a request's page keys, as (slot, pages, tier); PrefixIndex names and ranks
them. The reference for the native core's lookup (csrc/lookups.c).

A key's holders are kept sparse or dense (presence.py: pairs, or one int of packed
codes); a lookup first picks its candidates, the slots that may match (with full
layers the FULL holders of page 0, else every holder of any page), and packs the keys'
codes for them alone, a code byte per candidate (see presence.code), so that its
cost goes with the holders, not the table's slot count. The running AND of the ints
then says, for all candidates at once, which hold every page so far, in which pool and
on which tier at worst; Python-level work is per distinct match length, not per page or
node. Where every open slot is below 8, a key's packed codes are already one word and the
slots their own places: the walk takes them as they are, from a memo of each holder set's
packed int (the table's keys share few), with no Python loop per page.
The rule itself is the MatchRule's: every page before the end for full attention (the
running AND from page 0), the last `window_pages` for a window (ANDs over windows)."""

from __future__ import annotations

from functools import partial, reduce
from itertools import accumulate, count, takewhile
from operator import and_, is_not, or_
from typing import Iterable, Sequence

from .events import KEY_BYTES

_BYTES, _KEY_LEN = {bytes}, {KEY_BYTES}

CODE_BITS, CODE_MASK = 8, 0xFF  # a slot's code (presence.code) takes a byte of a packed int
_LOW = 3  # log2(CODE_BITS): a code's bit index -> its slot's place
_WORD = 1 << 64  # open slots' bits below it: every slot's code in one 64-bit word
_WORD_SLOTS = range(64 // CODE_BITS)  # there, a code's place is its slot
MEMO_MAX = 1 << 12  # distinct holder sets a table's PackedMemo keeps
# Shifts that bring a pool's bit of a code to bit 0 (presence.code's bits).
_F_DEV, _S_ANY, _S_DEV, _F_MEM, _S_MEM = 1, 2, 3, 4, 5

Match = tuple[int, int, int]  # (node slot, pages, the slowest Tier its match reads)
Holders = bytes | int  # 3-byte (slot, code) pairs while few slots hold a key, else packed


def pairs(held: Holders) -> list[tuple[int, int]]:
    """(slot, code) of each holder: a dense key's in slot order."""
    if isinstance(held, bytes):
        it = iter(held)
        return [(hi << 8 | lo, code) for hi, lo, code in zip(it, it, it)]
    out, x = [], held
    while x:
        shift = (x & -x).bit_length() - 1 & ~(CODE_BITS - 1)
        out.append((shift >> _LOW, x >> shift & CODE_MASK))
        x &= ~(CODE_MASK << shift)
    return out


def packed(held: Holders | None) -> int:
    """A key's holders as one int of packed codes (slot s at bits 8s to 8s + 7)."""
    if held is None or isinstance(held, int):
        return held or 0
    return sum(code << CODE_BITS * s for s, code in pairs(held))


class PackedMemo(dict[Holders | None, int]):
    """Holders -> their packed codes (`packed`), kept as asked for (up to MEMO_MAX, then
    afresh): lookups of a table with few slots read them through a C-level map."""

    def __missing__(self, held: Holders | None) -> int:
        if len(self) >= MEMO_MAX:
            self.clear()
        bits = self[held] = packed(held)
        return bits


class Lookups:
    """The presence table's queries; it owns the state they read."""

    _bits: dict[bytes, Holders]  # key -> its holders (never none)
    _ones: int  # bit 0 of every open slot's code
    _packed_of: PackedMemo
    window_pages: int
    has_full: bool

    def lookup(self, keys: Sequence[bytes]) -> list[Match]:
        """Each node slot's usable match length for these chained page keys, unordered."""
        if not keys:
            return []
        if set(map(type, keys)) != _BYTES or set(map(len, keys)) != _KEY_LEN:
            raise ValueError(f"lookup keys must be {KEY_BYTES}-byte bytes")
        word = self._ones < _WORD  # every open slot's code in one word: no repacking
        if word and not self.window_pages:  # full layers alone: one C-level pipeline
            held = map(self._packed_of.__getitem__, map(self._bits.get, keys))
            return self._runs(accumulate(held, and_), self._ones, _WORD_SLOTS)
        found = list(
            takewhile(partial(is_not, None), map(self._bits.get, keys))  # a full match
            if self.has_full  # needs every page: none goes past a key no slot holds
            else map(self._bits.get, keys)
        )
        if word:
            chain, ones, slots = self._word(found)
            if not ones:
                return []
        else:
            slots = self._candidates(found)
            if not slots:
                return []
            chain = self._local(found, slots)
            ones = (1 << CODE_BITS * len(slots)) // CODE_MASK  # bit 0 of every candidate's
        if not self.window_pages:
            return self._runs(accumulate(chain, and_), ones, slots)
        prefix = list(accumulate(chain, and_))
        out: list[Match] = []
        pending = 0 if self.has_full else ones  # without FULL runs, all scan from the end
        for n, group in self._full_runs(prefix, ones) if self.has_full else ():
            pending |= self._match_group(chain, prefix, n, group, slots, out)
        if pending:
            self._fall_back(chain, prefix, pending, slots, out)
        return out

    def _word(self, found: list[Holders | None]) -> tuple[list[int], int, Sequence[int]]:
        """`lookup`'s chain, candidates' bits and slots where every open slot is below 8:
        each key's packed codes as they are (slot s at code s: the slots are their own
        places), from the memo of packed holders (a C-level map; a table's keys share few
        holder sets), kept to the candidates' codes."""
        packed = list(map(self._packed_of.__getitem__, found))
        if self.has_full:  # the FULL holders of page 0
            ones = packed[0] & self._ones if packed else 0
        else:  # any page's holders
            x = reduce(or_, packed, 0)
            ones = (x | x >> _S_ANY) & self._ones  # a nonzero code has an ANY bit
        return list(map((ones * CODE_MASK).__and__, packed)), ones, _WORD_SLOTS

    def _candidates(self, found: list[Holders | None]) -> list[int]:
        """The open slots that may match, ascending: with full layers the FULL holders of
        page 0 (a match holds every page before its end), else any page's holders."""
        ones, full = self._ones, self.has_full
        seen: set[int] = set()
        for held in found[:1] if full else found:
            if held is not None:
                seen.update(
                    s
                    for s, code in pairs(held)
                    if (code & 1 or not full) and ones >> CODE_BITS * s & 1
                )
        return sorted(seen)

    @staticmethod
    def _local(found: list[Holders | None], slots: Sequence[int]) -> list[int]:
        """Each key's codes packed for the candidates alone: candidate i at code i."""
        place = {s: CODE_BITS * i for i, s in enumerate(slots)}
        chain = []
        for held in found:
            if held is None:
                chain.append(0)
            elif isinstance(held, int) and len(slots) < 4:  # a dense key: ask the few candidates
                chain.append(sum((held >> CODE_BITS * s & CODE_MASK) << place[s] for s in slots))
            else:
                chain.append(sum(code << place[s] for s, code in pairs(held) if s in place))
        return chain

    @staticmethod
    def _runs(prefix: Iterable[int], ones: int, slots: Sequence[int]) -> list[Match]:
        """`lookup` without SWA layers: a node's match is its FULL run from page 0, so the
        runs are the answer: from the running AND of the pages' holders, stopping where it
        is 0 (no candidate holding every page so far: no run goes further), each distinct
        running value -> where it ends. Bits outside `ones` (holders of no FULL page 0)
        never count."""
        ends = dict(zip(takewhile(bool, prefix), count(1)))
        out: list[Match] = []
        inner = 0
        for v in reversed(ends):  # longest run first; the AND only loses bits
            held = v & ones
            nodes = held & ~inner
            if nodes:
                n = ends[v]
                Lookups._emit(nodes, n, v >> _F_DEV, v >> _F_MEM, slots, out)
            inner = held
        return out

    @staticmethod
    def _full_runs(prefix: list[int], ones: int) -> list[tuple[int, int]]:
        """(F, nodes whose FULL run from page 0 is exactly F pages). The running AND only
        loses bits, so each distinct value is one run: the work is per run, not per page."""
        ends = dict(zip(prefix, count(1)))  # each run's value -> its end, in one C pass
        runs, inner = [], 0
        for v in reversed(ends):
            held = v & ones
            if held & ~inner:
                runs.append((ends[v], held & ~inner))
            inner = held
        return runs

    def _match_group(
        self,
        chain: list[int],
        prefix: list[int],
        n: int,
        group: int,
        slots: Sequence[int],
        out: list[Match],
    ) -> int:
        """Nodes that may match up to n pages: those holding the SWA window there match n;
        the others are returned, for `_fall_back`."""
        w, win = self.window_pages, -1
        if w:
            win = prefix[n - 1] if n <= w else reduce(and_, chain[n - w : n])
        ok = group & (win >> _S_ANY)
        full = prefix[n - 1] if self.has_full else -1
        device = (full >> _F_DEV) & (win >> _S_DEV)
        memory = (full >> _F_MEM) & (win >> _S_MEM)
        self._emit(ok, n, device, memory, slots, out)
        return group & ~ok

    def _fall_back(
        self,
        chain: list[int],
        prefix: list[int],
        pending: int,
        slots: Sequence[int],
        out: list[Match],
    ) -> None:
        """Nodes whose SWA window fails where their match could end (a tombstoned prefix the
        request leaves early, say): try shorter lengths, all such nodes in one downward scan."""
        wins, full = self._windows(chain, prefix), self.has_full
        for m in range(len(chain), 0, -1):
            run = prefix[m - 1] if full else -1
            hits = pending & (wins[m - 1] >> _S_ANY) & run
            if hits:
                device = (run >> _F_DEV) & (wins[m - 1] >> _S_DEV)
                memory = (run >> _F_MEM) & (wins[m - 1] >> _S_MEM)
                self._emit(hits, m, device, memory, slots, out)
                pending ^= hits
                if not pending:
                    return

    def _windows(self, chain: list[int], prefix: list[int]) -> list[int]:
        """wins[m - 1] = AND of chain over the window [max(0, m - W), m), for every m: ANDs
        over runs of 1, 2, 4.. pages by doubling, then two overlapping runs per window."""
        w, n = self.window_pages, len(chain)
        if w >= n:
            return prefix
        runs, k = chain, 1
        while 2 * k <= w:
            runs, k = list(map(and_, runs, runs[k:])), 2 * k
        return prefix[: w - 1] + list(map(and_, runs, runs[w - k :]))

    @staticmethod
    def _emit(
        nodes: int, n: int, device: int, memory: int, slots: Sequence[int], out: list[Match]
    ) -> None:
        """A match of n pages for each node of `nodes` (bit 0 of its code), on the tier the
        `device` and `memory` bits there say."""
        while nodes:
            low = nodes & -nodes
            nodes ^= low
            tier = 0 if device & low else 1 if memory & low else 2  # Tier's values
            out.append((slots[(low.bit_length() - 1) >> _LOW], n, tier))
