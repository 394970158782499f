"""What the index counts as a node's match: the attention policies' `needed` pages.

A node matches m pages when every pool's policy finds the pages it needs for m held
there. The index packs the two shapes `needed` takes (every page before m, for full
attention; the last w pages, for a window) into bit arithmetic (see PrefixIndex),
so this rule is read from the policies, never restated."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.layout import KVLayout
from ..cache.policies import policies_for


@dataclass(frozen=True)
class MatchRule:
    window_pages: int  # pages a window pool needs before a match's end (0: no window pool)
    has_full: bool = True  # a pool needs every page before the end

    def __post_init__(self) -> None:
        w = self.window_pages
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError(f"window_pages must be an int >= 0, got {w!r}")
        if not isinstance(self.has_full, bool):
            raise ValueError(f"has_full must be a bool, got {self.has_full!r}")
        if not self.has_full and w == 0:
            raise ValueError("a layout with neither full nor SWA layers has nothing to match")

    @classmethod
    def of(cls, layout: KVLayout) -> MatchRule:
        reach = [p.window_pages for p in policies_for(layout).values()]
        windows = [w for w in reach if w is not None]
        if len(windows) > 1:  # one code per node packs one window's bits
            raise ValueError(f"the index packs at most one window pool, got {len(windows)}")
        return cls(windows[0] if windows else 0, None in reach)
