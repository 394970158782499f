"""The `kvfabric` command."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

from kvfabric import _version

BENCHES = {
    "radix": "benchmarks.radix_bench",
    "transport": "benchmarks.transport_bench",
    "index": "benchmarks.index_bench",
    "tp-drift": "benchmarks.tp_drift",
    "staging": "benchmarks.staging_bench",
    "connector": "benchmarks.connector_bench",
    "disk": "benchmarks.disk_bench",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        prog="kvfabric", description="Cluster-wide KV-cache fabric on Ray."
    )
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version.__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo",
        help="vLLM engines on the fabric against vLLM's own prefix cache, fed a real trace "
        "(an embedded cluster unless --address)",
        add_help=False,
    )
    sub.add_parser(
        "replay",
        help="cluster-scale trace replay on the real fabric core, in simulated time",
        add_help=False,
    )
    sub.add_parser(
        "chaos",
        help="seeded faults over a running fabric and workload, then checks",
        add_help=False,
    )
    up = _on_a_cluster(
        sub,
        "up",
        help="deploy the fabric and the Serve app onto a running cluster; leave them up",
        description="Deploy the fabric and its Serve app (the reference model's, or vLLM "
        "engines under Ray Serve LLM with the fabric as their KV layer) onto a running Ray "
        "cluster, print the OpenAI endpoint, and leave them up (`kvfabric down` removes them).",
    )
    up.add_argument(
        "--host", default="127.0.0.1", help="HTTP bind address (default: localhost only)"
    )
    up.add_argument("--port", type=int, default=8000)
    up.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="vllm",
        help="vllm (default): vLLM engines under Ray Serve LLM with the fabric as their KV "
        "layer; reference: the bit-exact reference model's app",
    )
    up.add_argument(
        "--args",
        default="{}",
        help="app args as JSON, or @FILE of JSON (kvfabric.deploy.reference.serve.app.AppArgs; "
        "with --engine vllm, kvfabric.deploy.vllm.serve.app_args.LLMAppArgs)",
    )
    up.add_argument(
        "--config",
        metavar="FILE",
        help="your own engines: a YAML file of Ray Serve LLM's LLMConfig (model, engine_kwargs, "
        "deployment_config, ...), served with the fabric as its KV layer (--engine vllm); "
        "--args then gives only the fabric's settings",
    )
    up.add_argument(
        "--tenants",
        metavar="FILE",
        help="the tenant table: API keys and the namespaces "
        "each may use (JSON or YAML; deploy/serving/tenants.py); the same path on every node",
    )
    down = _on_a_cluster(
        sub,
        "down",
        help="remove the Serve app and the fabric from a running cluster",
        description="Remove the Serve app and the fabric's actors from a running Ray cluster.",
    )
    status = _on_a_cluster(
        sub,
        "status",
        help="each fabric on a running cluster: nodes, pool fill by tier, hit rates",
        description="Print every fabric on a running Ray cluster: its nodes, each pool's fill "
        "by tier, lookups and hit rates, stored and evicted pages, bytes fetched from other "
        "nodes, the engines staged for, and the models served from it.",
    )
    status.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    # Each benchmark parses its own options (`kvfabric bench NAME --help`).
    bench = sub.add_parser("bench", help="benchmarks against peers and limits", add_help=False)
    bench.add_argument("name", nargs="?", choices=sorted(BENCHES))
    args, rest = ap.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo

        return demo(rest)
    if args.command == "replay":
        from kvfabric.deploy.sim.replay import main as replay

        return replay(rest)
    if args.command == "chaos":
        from kvfabric.deploy.chaos.run import main as chaos

        return chaos(rest)
    if args.command == "status":
        if rest:
            status.error(f"unrecognized arguments: {' '.join(rest)}")
        return _status(args)
    if args.command in ("up", "down"):
        if rest:
            (up if args.command == "up" else down).error(
                f"unrecognized arguments: {' '.join(rest)}"
            )
        return _up(up, args) if args.command == "up" else _down(args)
    if args.name is None:
        if rest and rest[0] in ("-h", "--help"):
            print(_bench_usage())
            return 0
        bench.error(f"which benchmark? one of: {', '.join(sorted(BENCHES))}")
    try:
        _benchmarks()
    except FileNotFoundError as e:
        ap.error(str(e))
    return importlib.import_module(BENCHES[args.name]).main(rest) or 0


def _on_a_cluster(sub, name: str, **kw: str) -> argparse.ArgumentParser:
    """A subcommand that acts on a running Ray cluster: it takes `--address`."""
    parser = sub.add_parser(name, **kw)
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"))
    return parser


def _bench_usage() -> str:
    """Each benchmark with the first line of its module's docstring (read, not imported:
    a benchmark imports its peers)."""
    import ast

    folder = Path(_version.__file__).resolve().parent.parent / "benchmarks"
    lines = ["usage: kvfabric bench NAME [options]  (kvfabric bench NAME --help: its options)", ""]
    width = max(map(len, BENCHES))
    for name, module in sorted(BENCHES.items()):
        path = folder / f"{module.split('.')[-1]}.py"
        doc = ast.get_docstring(ast.parse(path.read_text())) if path.is_file() else None
        lines.append(f"  {name:<{width}}  {(doc or module).splitlines()[0]}")
    return "\n".join(lines)


def _benchmarks() -> ModuleType:
    """The repository's benchmarks/ package. It is not installed (its peers are not our
    dependencies): it lies beside the kvfabric folders of a source checkout, which is
    what the README's install (`pip install -e`) leaves."""
    folder = Path(_version.__file__).resolve().parent.parent / "benchmarks"
    loaded = sys.modules.get("benchmarks")
    if loaded is not None and Path(loaded.__file__ or "").resolve().parent == folder:
        return loaded
    init = folder / "__init__.py"
    if not init.is_file():
        raise FileNotFoundError(
            f"kvfabric bench runs from a source checkout of ray-kv-fabric "
            f"(pip install -e): no {init}"
        )
    spec = importlib.util.spec_from_file_location(
        "benchmarks", init, submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks"] = module
    spec.loader.exec_module(module)
    # A bench's spawned processes (the transport bench's NIXL peer) import `benchmarks` by
    # name: they get this process's sys.path. Last, so nothing installed is shadowed.
    if str(folder.parent) not in sys.path:
        sys.path.append(str(folder.parent))
    return module


def read_app_args(value: str) -> dict:
    """`--args`: a JSON object, or `@PATH` of a file holding one (`~` expanded); a
    ValueError saying which when it is not."""
    where = "--args"
    if value.startswith("@"):
        path = os.path.expanduser(value[1:])
        where = f"--args file {path}"
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read(1 << 20)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: {e}") from None
    try:
        app_args = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON: {e}") from None
    if not isinstance(app_args, dict):
        raise ValueError(f"{where} must be a JSON object")
    return app_args


def read_llm_config(path: str) -> dict:
    """`--config`: a YAML file holding one mapping (Ray's LLMConfig; validated by the app
    builder, which imports Ray Serve LLM); a ValueError saying which when it is not."""
    import yaml

    path = os.path.expanduser(path)
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f.read(1 << 20))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--config file {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config file {path} must hold a mapping (an LLMConfig)")
    return config


def _up(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        app_args = read_app_args(args.args)
        if args.config is not None:
            if args.engine != "vllm":
                raise ValueError("--config gives vLLM engines' LLMConfig: use --engine vllm")
            if "llm_config" in app_args:
                raise ValueError("give the LLMConfig with --config or in --args, not both")
            app_args["llm_config"] = read_llm_config(args.config)
    except ValueError as e:
        ap.error(str(e))
    try:
        _check_app_args(ap, args, app_args)
    except (ValueError, TypeError) as e:  # bad args fail here, not in a replica
        ap.error(str(e))
    from kvfabric.deploy.harness.cluster import DeployFailed, connect, up

    connect(args.address)
    try:
        endpoint = up(app_args, host=args.host, port=args.port, engine=args.engine)
    except (DeployFailed, TimeoutError) as e:  # Serve's own words: no traceback of ours
        print(f"kvfabric up: {e}", file=sys.stderr)
        return 1
    routes = "/v1/completions" + (", /v1/chat/completions" if args.engine == "vllm" else "")
    print(f"kvfabric is up at {endpoint.base_url}: {routes} (models: /v1/models)")
    return 0


def _check_app_args(ap: argparse.ArgumentParser, args: argparse.Namespace, app_args: dict) -> None:
    """Validate `app_args` for the engine (adding --tenants to them)."""
    if args.tenants is not None:
        if "tenants_file" in app_args:
            ap.error("give the tenant table with --tenants or in --args, not both")
        app_args["tenants_file"] = os.path.abspath(os.path.expanduser(args.tenants))
    if args.engine == "vllm":
        from kvfabric.deploy.serving.tenants import load_tenants
        from kvfabric.deploy.vllm.serve.app_args import LLMAppArgs

        parsed = LLMAppArgs.from_dict(app_args)
        if parsed.tenants_file:
            load_tenants(parsed.tenants_file)
        return
    from kvfabric.deploy.reference.serve.app import AppArgs

    AppArgs.from_dict(app_args).tenants()


def _status(args: argparse.Namespace) -> int:
    from kvfabric.deploy.harness.cluster import connect

    from .status import as_json, fabric_status, render

    connect(args.address)
    fabrics = fabric_status()
    print(json.dumps(as_json(fabrics)) if args.json else render(fabrics))
    return 0


def _down(args: argparse.Namespace) -> int:
    from kvfabric.deploy.harness.cluster import connect, down

    connect(args.address)
    killed = down()
    print(f"kvfabric is down ({len(killed)} actors stopped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
