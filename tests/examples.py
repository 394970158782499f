"""How many examples a property test with its own count runs under the active profile.

A test names the count it wants on a developer's run (the `dev` profile, 150 by default);
`examples(n)` scales it by the active profile, so CI (`ci`, 40), the sanitizers
(`sanitize`, 15) and `KVF_HYPOTHESIS=full` (10,000) scale every such test alike instead of
each keeping its developer's count."""

from __future__ import annotations

from hypothesis import settings

DEV_EXAMPLES = 150  # the `dev` profile's count: the one the tests' own counts are written for


def examples(n: int) -> int:
    """`n` examples on a developer's run, scaled by the active profile (at least 5)."""
    return max(5, n * settings.default.max_examples // DEV_EXAMPLES)
