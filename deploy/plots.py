"""The demo's figure: hit rate over the replay, and TTFT with and without the fabric."""
from __future__ import annotations

from pathlib import Path

from .replay import Pair


def write_png(pairs: list[Pair], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")             # no display: render to a file
    import matplotlib.pyplot as plt

    done = [p for p in pairs if p.baseline and p.fabric]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    hits = prompt = 0
    rate = []
    for p in done:
        hits += p.fabric.cached_tokens
        prompt += p.fabric.prompt_tokens
        rate.append(hits / prompt if prompt else 0.0)
    left.plot(range(1, len(rate) + 1), rate, label="fabric")
    left.plot(range(1, len(rate) + 1), [0.0] * len(rate), label="caching off")
    left.set(title="cumulative prompt-token hit rate", xlabel="request", ylabel="hit rate", ylim=(0, 1))
    left.legend()
    fabric = sorted(p.fabric.ttft_ms for p in done)
    base = sorted(p.baseline.ttft_ms for p in done)
    for values, label in ((fabric, "fabric"), (base, "caching off")):
        right.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    right.set(title="TTFT distribution", xlabel="TTFT (ms)", ylabel="fraction of requests", xscale="log")
    right.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
