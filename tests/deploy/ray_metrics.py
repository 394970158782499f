"""What Ray's agents export to Prometheus, read as a scraper would: every alive node's
metrics port, the samples of one metric family."""

from __future__ import annotations

import re
import urllib.request

import ray

_SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(name: str, timeout_s: float = 60.0) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric `name` on every alive node."""
    out = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            for line in r.read().decode().splitlines():
                m = _SAMPLE.match(line)
                if m and m[1] == name:
                    out.append((dict(_LABEL.findall(m[2])), float(m[3])))
    return out
