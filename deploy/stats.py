"""The one percentile definition every report of this project uses."""

from __future__ import annotations

import math
from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-quantile (0 <= q <= 1), interpolated linearly between the closest ranks
    (numpy's default, and `statistics.quantiles(method="inclusive")`); NaN when empty."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    if not values:
        return math.nan
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)
