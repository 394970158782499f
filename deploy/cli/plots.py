"""The demos' figure: cumulative hit rate over the replay, and TTFT distributions."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence


def cumulative_rate(hits: Sequence[int], totals: Sequence[int]) -> list[float]:
    out, h, t = [], 0, 0
    for a, b in zip(hits, totals):
        h, t = h + a, t + b
        out.append(h / t if t else 0.0)
    return out


def write_png(
    path: Path, hit_rates: Mapping[str, Sequence[float]], ttfts_ms: Mapping[str, Sequence[float]]
) -> Path:
    """`hit_rates`: per label, the cumulative prompt-token hit rate after each request;
    `ttfts_ms`: per label, every request's time to first token."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, rate in hit_rates.items():
        left.plot(range(1, len(rate) + 1), rate, label=label)
    left.set(
        title="cumulative prompt-token hit rate", xlabel="request", ylabel="hit rate", ylim=(0, 1)
    )
    left.legend()
    for label, values in ttfts_ms.items():
        values = sorted(values)
        right.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    right.set(
        title="TTFT distribution", xlabel="TTFT (ms)", ylabel="fraction of requests", xscale="log"
    )
    right.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
