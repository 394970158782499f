"""What the deployment manifest tests share: where the manifests are, and what they are
checked against (pyproject.toml's pins, the code's import paths, the `kvfabric` command's
parser). The tests: tests/deploy/test_manifests_rayservice.py (KubeRay) and
tests/deploy/test_manifests_cluster.py (Ray cluster launcher, and the commands all name)."""

from __future__ import annotations

import argparse
import importlib
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "manifests"
RAYSERVICES = {
    "reference": MANIFESTS / "rayservice.yaml",
    "vllm": MANIFESTS / "rayservice-vllm.yaml",
}
CLUSTER = MANIFESTS / "cluster.yaml"
GPU = "nvidia.com/gpu"


def read_pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def project_deps(pyproject, extras: tuple[str, ...] = ()) -> dict[str, Requirement]:
    """The runtime dependencies and those of `extras`, by canonical name."""
    reqs = [Requirement(d) for d in pyproject["project"]["dependencies"]]
    for extra in extras:
        reqs += [Requirement(d) for d in pyproject["project"]["optional-dependencies"][extra]]
    return {canonicalize_name(r.name): r for r in reqs}


def ray_version(pyproject) -> str:
    """The Ray the development environment pins (requirements/constraints.txt): the release
    the images run, within the package's range."""
    pins = [
        Requirement(line.split("#")[0].strip())
        for line in (ROOT / "requirements" / "constraints.txt").read_text().splitlines()
        if line.split("#")[0].strip()
    ]
    (ray,) = [r for r in pins if canonicalize_name(r.name) == "ray"]
    (spec,) = [s for s in ray.specifier if s.operator == "=="]
    assert project_deps(pyproject)["ray"].specifier.contains(spec.version), (spec, pyproject)
    return spec.version


def py_tag(pyproject) -> str:
    m = re.search(r">=\s*3\.(\d+)", pyproject["project"]["requires-python"])
    assert m, "requires-python has a lower bound"
    return f"py3{m.group(1)}"


def resolve(import_path: str):
    module, _, attr = import_path.partition(":")
    assert module and attr, f"{import_path!r} is not module:attribute"
    return getattr(importlib.import_module(module), attr)


def cli_parsers(main) -> dict[str, argparse.ArgumentParser]:
    """The subcommands `main`'s parser accepts and their parsers, read from the parser it builds."""

    class Built(Exception):
        """Raised from parse_args to stop `main` once its parser is built."""

    seen: list[argparse.ArgumentParser] = []

    def capture(self, *args, **kwargs):
        seen.append(self)
        raise Built

    mp = pytest.MonkeyPatch()
    mp.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    try:
        with pytest.raises(Built):
            main(["__probe__"])
    finally:
        mp.undo()
    (sub,) = [a for a in seen[0]._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)
