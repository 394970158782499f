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
    path: Path,
    hit_rates: Mapping[str, Sequence[float]],
    ttfts_ms: Mapping[str, Sequence[float]],
    title: str = "",
    tiers: Mapping[str, Mapping[str, int]] | None = None,
) -> Path:
    """`hit_rates`: per label, the cumulative prompt-token hit rate after each request;
    `ttfts_ms`: per label, every request's time to first token (its p50 marked);
    `tiers`: per label, the prompt tokens each source served (a third panel, stacked)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a file
    import matplotlib.pyplot as plt

    panels = 3 if tiers else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.4))
    left, right = axes[0], axes[1]
    for label, rate in hit_rates.items():
        left.plot(range(1, len(rate) + 1), rate, label=label)
    left.set(
        title="cumulative prompt-token hit rate", xlabel="request", ylabel="hit rate", ylim=(0, 1)
    )
    left.legend()
    for label, values in ttfts_ms.items():
        values = sorted(values)
        if not values:
            continue
        (line,) = right.plot(
            values, [(i + 1) / len(values) for i in range(len(values))], label=label
        )
        p50 = values[(len(values) - 1) // 2]
        right.axvline(p50, color=line.get_color(), linestyle="--", linewidth=0.8)
        right.annotate(
            f"p50 {p50:.0f} ms",
            (p50, 0.5),
            color=line.get_color(),
            fontsize=8,
            xytext=(3, 0),
            textcoords="offset points",
        )
    right.set(
        title="TTFT distribution (dashed: p50)",
        xlabel="TTFT (ms)",
        ylabel="fraction of requests",
        xscale="log",
    )
    right.legend()
    if tiers:
        labels = list(tiers)
        sources = list(dict.fromkeys(src for by in tiers.values() for src in by))
        bottom = [0.0] * len(labels)
        for src in sources:
            shares = []
            for label in labels:
                total = sum(tiers[label].values()) or 1
                shares.append(tiers[label].get(src, 0) / total)
            axes[2].bar(labels, shares, bottom=bottom, label=src)
            bottom = [b + v for b, v in zip(bottom, shares)]
        axes[2].set(title="prompt tokens by source", ylabel="share of prompt tokens", ylim=(0, 1))
        axes[2].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
