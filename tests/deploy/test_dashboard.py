"""deploy/manifests/grafana-dashboard.json stays true to the code: every metric it
queries is one the fabric exports under that name (the node actors' node_metrics.py, the
index shards' index_metrics.py,
the vLLM connector's connector_metrics.py, the reference app's serving.py, as Ray's
Prometheus export names them), every panel has a query, and the fabric variable reads
a metric that exists. A renamed metric fails here, not on an operator's empty graph."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvfabric.actors import index_metrics
from kvfabric.actors.node import node_metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "manifests" / "grafana-dashboard.json"
_RAY = re.compile(r"\bray_[a-z_]+\b")


def exported() -> set[str]:
    """The Prometheus names Ray gives each metric the fabric records."""
    names = {f"ray_{g}" for g in node_metrics.GAUGES}
    names |= {f"ray_kvfabric_node_{c}_total" for c, _ in node_metrics.COUNTERS}
    names |= {f"ray_{g}" for g in index_metrics.GAUGES}
    names |= {f"ray_{c}_total" for c in index_metrics.COUNTERS}
    connector = (ROOT / "deploy" / "vllm" / "connector" / "metrics.py").read_text()
    names |= {f"ray_vllm_{n}_total" for n in re.findall(r'"vllm:(kvfabric_\w+)"', connector)}
    serving = (ROOT / "deploy" / "reference" / "serve" / "server.py").read_text()
    for kind, name in re.findall(r'metrics\.(Counter|Histogram|Gauge)\(\s*"(\w+)"', serving):
        suffixes = {"Counter": ("_total",), "Histogram": ("_bucket", "_sum", "_count")}
        names |= {f"ray_{name}{s}" for s in suffixes.get(kind, ("",))}
    return names


def test_every_queried_metric_is_exported():
    dash = json.loads(DASHBOARD.read_text())
    known = exported()
    assert "ray_kvfabric_node_pages" in known and "ray_vllm_kvfabric_lookups_total" in known
    queried = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            queried |= set(_RAY.findall(target["expr"]))
    for var in dash["templating"]["list"]:
        queried |= set(_RAY.findall(json.dumps(var.get("query", ""))))
    assert queried and queried <= known, sorted(queried - known)


def test_panels_are_laid_out_without_overlap():
    cells = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        g = panel["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine and g["x"] + g["w"] <= 24, panel["title"]
        cells |= mine
