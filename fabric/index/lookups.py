"""The prefix index's lookups on the pure-Python presence table: each node slot's usable
match for a request's page keys, as (slot, pages, device); PrefixIndex names and ranks
them. The reference for the native core's lookup (csrc/lookup.c).

A node's masks along the keys are packed in one int per key, a 4-bit nibble per node
slot (see prefix_index._code), so the running AND of the ints says, for all nodes at
once, which hold every page so far, in which pool and tier. The work per page is done
in C iterators; Python-level work is per distinct match length, not per page or node.
The rule itself is the MatchRule's: every page before the end for full attention (the
running AND from page 0), the last `window_pages` for a window (ANDs over windows)."""

from __future__ import annotations

from functools import reduce
from itertools import accumulate, count, repeat, takewhile
from operator import and_
from typing import Sequence

from .events import KEY_BYTES

_BYTES, _KEY_LEN = {bytes}, {KEY_BYTES}

Match = tuple[int, int, bool]  # (node slot, pages, device)


class Lookups:
    """The presence table's queries; it owns the state they read."""

    _bits: dict[bytes, int]  # key -> packed holders' nibbles (never 0)
    _ones: int  # bit 0 of every open slot's nibble
    window_pages: int
    has_full: bool

    def lookup(self, keys: Sequence[bytes]) -> list[Match]:
        """Each node slot's usable match length for these chained page keys, unordered."""
        if not keys:
            return []
        if set(map(type, keys)) != _BYTES or set(map(len, keys)) != _KEY_LEN:
            raise ValueError(f"lookup keys must be {KEY_BYTES}-byte bytes")
        if not self.window_pages:
            return self._lookup_full(keys)
        chain, prefix = self._walk(keys)
        if not chain:
            return []
        out: list[Match] = []
        pending = 0 if self.has_full else self._ones  # without FULL runs, all scan from the end
        for n, group in self._full_runs(prefix) if self.has_full else ():
            pending |= self._match_group(chain, prefix, n, group, out)
        if pending:
            self._fall_back(chain, prefix, pending, out)
        return out

    def _lookup_full(self, keys: Sequence[bytes]) -> list[Match]:
        """`lookup` without SWA layers: a node's match is its FULL run from page 0, so the
        runs are the answer. One C pipeline, no per-page list: holders of each page, their
        running AND, stopping where it is 0 (a missing key, or no node holding every page
        so far: no run goes further), and each distinct running value -> where it ends."""
        ends = dict(
            zip(takewhile(bool, accumulate(map(self._bits.get, keys, repeat(0)), and_)), count(1))
        )
        ones, out, inner = self._ones, [], 0
        for v in reversed(ends):  # longest run first; the AND only loses bits
            held = v & ones
            nodes = held & ~inner
            if nodes:
                n = ends[v]
                while nodes:
                    low = nodes & -nodes
                    nodes ^= low
                    out.append(((low.bit_length() - 1) >> 2, n, bool(v & (low << 1))))
            inner = held
        return out

    def _walk(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """The packed holders of each page a match may reach, and their running AND from
        page 0; C-level iterators, as this is most of a lookup's work."""
        if self.has_full:  # stop at the first key no node holds (held keys have bits != 0)
            chain = list(takewhile(bool, map(self._bits.get, keys, repeat(0))))
        else:  # without full layers only a window must be held: no stopping early
            chain = list(map(self._bits.get, keys, repeat(0)))
        return chain, list(accumulate(chain, and_))

    def _full_runs(self, prefix: list[int]) -> list[tuple[int, int]]:
        """(F, nodes whose FULL run from page 0 is exactly F pages). The running AND only
        loses bits, so each distinct value is one run: the work is per run, not per page."""
        ends = dict(zip(prefix, count(1)))  # each run's value -> its end, in one C pass
        ones, runs, inner = self._ones, [], 0
        for v in reversed(ends):
            held = v & ones
            if held & ~inner:
                runs.append((ends[v], held & ~inner))
            inner = held
        return runs

    def _match_group(
        self, chain: list[int], prefix: list[int], n: int, group: int, out: list[Match]
    ) -> int:
        """Nodes that may match up to n pages: those holding the SWA window there match n;
        the others are returned, for `_fall_back`."""
        w, win = self.window_pages, -1
        if w:
            win = prefix[n - 1] if n <= w else reduce(and_, chain[n - w : n])
        ok = group & (win >> 2)
        self._emit(ok, n, (prefix[n - 1] >> 1 if self.has_full else -1) & (win >> 3), out)
        return group & ~ok

    def _fall_back(
        self, chain: list[int], prefix: list[int], pending: int, out: list[Match]
    ) -> None:
        """Nodes whose SWA window fails where their match could end (a tombstoned prefix the
        request leaves early, say): try shorter lengths, all such nodes in one downward scan."""
        wins, full = self._windows(chain, prefix), self.has_full
        for m in range(len(chain), 0, -1):
            hits = pending & (wins[m - 1] >> 2) & (prefix[m - 1] if full else -1)
            if hits:
                self._emit(hits, m, (prefix[m - 1] >> 1 if full else -1) & (wins[m - 1] >> 3), out)
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
    def _emit(nodes: int, n: int, device: int, out: list[Match]) -> None:
        while nodes:
            low = nodes & -nodes
            nodes ^= low
            out.append(((low.bit_length() - 1) >> 2, n, bool(device & low)))
