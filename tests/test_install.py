"""The distribution installs one top-level package, `kvfabric`, whose subpackages are the
repository's layer folders; a user's environment that already has `fabric` (the SSH
library) keeps it, and gets ours beside it."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "kvfabric" / "_version.py").read_text())[1]
LAYERS = ("core", "transport", "actors", "deploy")
SOURCES = ("kvfabric", *LAYERS, "pyproject.toml", "setup.py", "README.md", "LICENSE")


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _folders() -> set[str]:
    found = {"kvfabric"}
    for layer in LAYERS:
        for init in (ROOT / layer).rglob("__init__.py"):
            found.add("kvfabric." + ".".join(init.parent.relative_to(ROOT).parts))
    return found


def test_every_package_folder_is_listed_and_mapped():
    setuptools = _pyproject()["tool"]["setuptools"]
    assert set(setuptools["packages"]) == _folders()
    assert setuptools["package-dir"] == {
        "kvfabric": "kvfabric",
        **{f"kvfabric.{layer}": layer for layer in LAYERS},
    }


def _run(
    cmd: list, cwd: Path, timeout: float = 300, pythonpath: Path | None = None
) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "KVF_NATIVE")
    }
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _copy_sources(src: Path) -> Path:
    """What a wheel is built from, copied to `src` without build outputs."""
    src.mkdir(parents=True)
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(path, src / name)
    return src


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """Our sdist, built from a copy of the sources through setuptools' PEP 517 hook (what
    `python -m build --sdist` calls)."""
    tmp = tmp_path_factory.mktemp("sdist")
    src = _copy_sources(tmp / "src")
    hook = f"from setuptools import build_meta; build_meta.build_sdist({str(tmp / 'dist')!r})"
    out = _run([sys.executable, "-c", hook], cwd=src)
    assert out.returncode == 0, out.stderr[-3000:]
    (built,) = (tmp / "dist").glob("*.tar.gz")
    return built


@pytest.fixture(scope="module")
def wheel(sdist, tmp_path_factory) -> Path:
    """Our wheel, built from the sdist as pip builds one for a user who downloads it: a
    file the sdist lacks fails this build (the checkout gets no build folders)."""
    tmp = tmp_path_factory.mktemp("wheel")
    out = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            tmp / "dist",
            sdist,
        ],
        cwd=tmp,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (built,) = (tmp / "dist").glob("*.whl")
    return built


def test_the_sdist_holds_the_sources_and_nothing_built(sdist):
    import tarfile

    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    csrc = {str(p.relative_to(ROOT)) for p in ROOT.glob("core/*/csrc/*.[ch]")}
    csrc |= {str(p.relative_to(ROOT)) for p in ROOT.glob("transport/csrc/*.[ch]")}
    assert csrc and csrc <= names, sorted(csrc - names)
    assert {"LICENSE", "README.md", "pyproject.toml", "setup.py", "PKG-INFO"} <= names
    assert "deploy/sim/traces/conversation_trace.jsonl" in names
    assert not [n for n in names if n.endswith((".so", ".pyc"))]
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", ".venv/"))]


def test_the_wheel_holds_kvfabric_only(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvfabric"}
    assert "kvfabric/core/cache/node_cache.py" in names
    assert "kvfabric/deploy/sim/traces/conversation_trace.jsonl" in names
    native = [
        n for n in names if n.startswith("kvfabric/core/cache/_pagekeys.") and n.endswith(".so")
    ]
    assert len(native) == 1, "the wheel must hold the built page-key extension"
    index = [
        n for n in names if n.startswith("kvfabric/core/index/_presence.") and n.endswith(".so")
    ]
    assert len(index) == 1, "the wheel must hold the built index-core extension"
    tree = [n for n in names if n.startswith("kvfabric/core/cache/_radix.") and n.endswith(".so")]
    assert len(tree) == 1, "the wheel must hold the built radix-tree extension"
    got = [n for n in names if n.startswith("kvfabric/core/cache/_alloc.") and n.endswith(".so")]
    assert len(got) == 1, "the wheel must hold the built page-allocator extension"
    plan = [n for n in names if n.startswith("kvfabric/transport/_plan.") and n.endswith(".so")]
    assert len(plan) == 1, "the wheel must hold the built read-plan extension"
    assert not any("/csrc/" in n for n in names), "C sources stay out of the wheel"
    assert not any(n.startswith(("benchmarks/", "tests/", "kvfabric/benchmarks/")) for n in names)
    assert "kvfabric = kvfabric.deploy.cli.main:main" in entry_points
    assert "kvfabric = kvfabric.deploy.chaos.pytest_plugin" in entry_points


CHECK = """
import fabric, kvfabric, kvfabric.core
from kvfabric import NodeCache, KVLayout, PoolName, PoolCapacity
from kvfabric.deploy.sim.trace import load_trace
from kvfabric.core.cache import native
assert native.ENABLED and "site-packages" in native.KEYS.__file__, "the keys load from the wheel"
from kvfabric.core.index import presence
from kvfabric.core.index.prefix_index import PrefixIndex
from kvfabric.core import MatchRule
assert presence.ENABLED and "site-packages" in presence.EXT.__file__, "the index loads from it"
assert type(PrefixIndex(MatchRule(0))._presence) is presence.EXT.Presence
from kvfabric.core.cache import radix
assert radix.ENABLED and "site-packages" in radix.EXT.__file__, "the tree loads from the wheel"
from kvfabric.transport.native_plan import PLAN
assert PLAN is not None and "site-packages" in PLAN.__file__, "the read plan loads from it"
assert fabric.Connection.__module__.startswith("fabric."), "fabric is the SSH library"
assert "site-packages" in kvfabric.core.__file__, kvfabric.core.__file__
layout = KVLayout(layers=("full",), kv_heads=1, head_dim=4, page_size=2)
cache = NodeCache(layout, {PoolName.FULL: PoolCapacity(device=4, host=0)}, store_bytes=False)
cache.put([1, 2, 3, 4], None, "ns")
assert cache.match([1, 2, 3, 4], "ns").usable_pages == 2
assert cache.tree.native and type(cache.tree.root(b"r")) is radix.EXT.TreeNode
from kvfabric.core.cache import allocator
pages = cache.registry.pool(PoolName.FULL, kvfabric.core.Tier.DEVICE).allocator
assert allocator.ENABLED and type(pages) is allocator.EXT.PageAllocator, "so does the allocator"
assert len(load_trace()) > 0
print("ok")
"""


def test_installs_beside_the_fabric_ssh_library(wheel, tmp_path):
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    ssh = _run([py, "-m", "pip", "install", "-q", "fabric==3.2.3"], cwd=tmp_path)
    if ssh.returncode != 0:
        pytest.skip(f"the package index is out of reach: {ssh.stderr.strip()[-300:]}")
    # Our dependencies (torch, ray, ...) come from the test's environment, after the
    # fresh venv's own packages, so `fabric` there stays the SSH library.
    site = Path(
        _run(
            [py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp_path
        ).stdout.strip()
    )
    (site / "zz_test_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # Not installed, the source tree on sys.path (as a Ray runtime_env working_dir puts it).
    from_tree = _run(
        [py, "-c", "import kvfabric.deploy.reference.serve.app as m; print(m.__file__)"],
        cwd=tmp_path,
        pythonpath=ROOT,
    )
    assert from_tree.returncode == 0, from_tree.stderr[-3000:]
    assert from_tree.stdout.strip() == str(ROOT / "deploy" / "reference" / "serve" / "app.py")
    ours = _run([py, "-m", "pip", "install", "-q", "--no-deps", wheel], cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr[-3000:]
    checked = _run([py, "-c", CHECK], cwd=tmp_path)
    assert checked.returncode == 0 and checked.stdout.strip() == "ok", checked.stderr[-3000:]
    version = _run([venv / "bin" / "kvfabric", "--version"], cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.split() == ["kvfabric", VERSION], version
    assert wheel.name.startswith(f"ray_kv_fabric-{VERSION}-"), wheel.name
    helped = _run([venv / "bin" / "kvfabric", "--help"], cwd=tmp_path)
    assert helped.returncode == 0 and "demo" in helped.stdout, helped.stderr[-2000:]
    bench = _run([venv / "bin" / "kvfabric", "bench", "radix"], cwd=tmp_path)
    assert bench.returncode == 2 and "source checkout" in bench.stderr, bench.stderr[-2000:]
    if importlib.util.find_spec("vllm") is not None:
        # Under the vLLM this machine runs (the test environment's, as the user's own).
        under = _run([py, "-c", CHECK_VLLM], cwd=tmp_path, timeout=600)
        assert under.returncode == 0 and under.stdout.split()[-1] == "ok", under.stderr[-3000:]


CHECK_VLLM = """
import kvfabric
from kvfabric import with_fabric, FabricLLMServer
from kvfabric.deploy.vllm.connector import FabricConnector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from ray.serve.llm import LLMConfig
assert issubclass(FabricConnector, KVConnectorBase_V1)
assert "site-packages" in kvfabric.__file__, kvfabric.__file__
config = with_fabric(LLMConfig(model_loading_config={"model_id": "m", "model_source": "org/m"}))
assert config.server_cls is FabricLLMServer
print(kvfabric.__version__, "ok")
"""


# -- as users install it ------------------------------------------------------------------
def _requirements(wheel: Path, extra: str = "") -> list[str]:
    """The wheel's declared requirements (those of `extra`, if given), markers dropped."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    out = []
    for line in meta.splitlines():
        if line.startswith("Requires-Dist: "):
            req, _, marker = line[len("Requires-Dist: ") :].partition(";")
            if (f'extra == "{extra}"' in marker) if extra else not marker.strip():
                out.append(req.strip())
    return out


def _need_the_index(tmp: Path) -> None:
    """Skip unless the package index answers (a small download)."""
    got = _run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp / "probe"]
        + ["six==1.16.0"],
        cwd=tmp,
        timeout=120,
    )
    if got.returncode != 0:
        pytest.skip(f"the package index is out of reach: {got.stderr.strip()[-300:]}")


def _dry_run(reqs: list[str], python: str, tmp: Path) -> subprocess.CompletedProcess:
    """pip's resolution of `reqs` for CPython `python` (wheels only, nothing installed)."""
    return _run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
        + ["--python-version", python, "--only-binary=:all:", "--target", tmp / "none", *reqs],
        cwd=tmp,
        timeout=600,
    )


def test_it_resolves_beside_ray_llm_and_beside_vllm_on_python_312(wheel, tmp_path):
    """The dry run a user's `pip install` does, on Python 3.12 (the usual vLLM image):
    the package beside `ray[llm]` (which brings NIXL 1.3.2 and its own vLLM), and its
    `vllm` extra beside `ray[serve]` (the connector's vLLM window)."""
    core = _requirements(wheel)
    assert any(r.startswith("nixl-cu12") for r in core) and "numpy>=1.24" in core, core
    _need_the_index(tmp_path)
    beside_llm = _dry_run(["ray[llm]==2.60.0", *core], "3.12", tmp_path)
    assert beside_llm.returncode == 0, beside_llm.stderr[-3000:]
    vllm = _requirements(wheel, "vllm")
    assert any(r.startswith("vllm") for r in vllm), vllm
    beside_serve = _dry_run(["ray[serve]==2.60.0", *core, *vllm], "3.12", tmp_path)
    assert beside_serve.returncode == 0, beside_serve.stderr[-3000:]


_EXTENSIONS = ("_pagekeys", "_radix", "_alloc", "_copy", "_crc32c", "_presence", "_plan")

_LOAD = f"""
import glob, importlib.machinery, importlib.util, sys
found = sorted(glob.glob("kvfabric/core/*/_*.so") + glob.glob("kvfabric/transport/_*.so"))
names = sorted(p.split("/")[-1].split(".")[0] for p in found)
assert names == {sorted(_EXTENSIONS)!r}, found
for path in found:
    name = path[:-len(path.split("/")[-1])].replace("/", ".") + path.split("/")[-1].split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
print(sys.version_info[:2])
"""


def _python(version: str) -> str | None:
    """An interpreter of CPython `version` that runs (a pyenv shim may name one that is
    not active), or None."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for found in [*sorted(pyenv.glob(f"{version}.*/bin/python")), shutil.which(f"python{version}")]:
        if found is None:
            continue
        ran = _run([found, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], ROOT, 30)
        if ran.returncode == 0 and ran.stdout.strip() == version:
            return str(found)
    return None


@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_the_c_extensions_build_without_warnings_and_load_on_python(version, tmp_path):
    """requires-python admits 3.12 and 3.13: the C core builds there as users build it (pip,
    an isolated build environment), with no compiler warning, and each module loads."""
    python = _python(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine")
    _need_the_index(tmp_path)  # pip builds in an isolated environment, setuptools from it
    src = _copy_sources(tmp_path / "src")
    built = _run(
        [python, "-m", "pip", "wheel", "-v", "--no-deps", "-w", tmp_path / "dist", src],
        cwd=tmp_path,
        timeout=600,
    )
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    warnings = re.findall(r"\S+\.[ch]:\d+:\d+: warning: .*", built.stdout + built.stderr)
    assert not warnings, warnings[:5]
    (whl,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(whl) as z:
        z.extractall(tmp_path / "unpacked")
    loaded = _run([python, "-c", _LOAD], cwd=tmp_path / "unpacked")
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.strip() == f"({version.replace('.', ', ')})"


def test_each_c_extension_exports_its_pyinit_alone_and_prefixes_what_its_files_share():
    """As CPython's own modules: the symbols a module's files share are prefixed (radix_,
    kvf_), and the shared object exports PyInit alone (-fvisibility=hidden), so no name of
    ours can collide with another library's in the process."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) on this machine")
    built = {
        p.name.split(".")[0]: p
        for layer in ("core", "transport")
        for p in (ROOT / layer).rglob("_*.so")
        if ".cache" not in p.parts
    }
    assert set(_EXTENSIONS) <= set(built), sorted(built)
    for name in _EXTENSIONS:
        exported = _run([nm, "-D", "--defined-only", built[name]], ROOT, 60).stdout
        assert _globals(exported) == [f"PyInit_{name}"], (name, _globals(exported))
        shared = _globals(_run([nm, "--defined-only", built[name]], ROOT, 60).stdout)
        unprefixed = [s for s in shared if not s.startswith(("PyInit_", "radix_", "kvf_"))]
        assert not unprefixed, (name, unprefixed)


def _globals(nm_output: str) -> list[str]:
    """The global code and data symbols an `nm` listing names."""
    return sorted(
        parts[2]
        for parts in (line.split() for line in nm_output.splitlines())
        if len(parts) == 3 and parts[1] in "TDBR"
    )
