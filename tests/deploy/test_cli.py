import json

import pytest
from kvfabric.deploy.cli.main import main


def test_demo_serves_a_trace_slice_on_three_nodes_and_matches_uncached_output(capsys, tmp_path):
    plot = tmp_path / "demo.png"
    assert (
        main(
            [
                "demo",
                "--engine",
                "reference",
                "--requests",
                "9",
                "--tokens-per-block",
                "16",
                "--json",
                "--plot",
                str(plot),
                "--log",
                str(tmp_path / "demo.log"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr()
    out = json.loads(printed.out.strip().splitlines()[-1])
    assert out["requests"] == 9 and out["failed_requests"] == 0 and out["output_mismatches"] == 0
    hits = out["device_hit_tokens"] + out["host_hit_tokens"] + out["remote_hit_tokens"]
    assert 0 < hits <= out["prompt_tokens"] and out["hit_rate"] == pytest.approx(
        hits / out["prompt_tokens"], abs=1e-4
    )
    assert (out["remote_fetches"] > 0) == (out["remote_bytes"] > 0) and out["remote_fetches"] <= 9
    assert 0 < out["ttft_p50_ms_fabric"] <= out["ttft_p99_ms_fabric"]
    assert 0 < out["ttft_p50_ms_nocache"] <= out["ttft_p99_ms_nocache"]
    ratio = out["ttft_p50_ms_fabric"] / out["ttft_p50_ms_nocache"]
    assert out["ttft_ratio"] == pytest.approx(ratio, abs=2e-3)
    assert 1 <= out["nodes_used"] <= 3
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The console keeps the demo's own lines; Ray's and Serve's went to the log it named.
    assert f"logs: {tmp_path / 'demo.log'}" in printed.err
    assert "serve" in (tmp_path / "demo.log").read_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--requests", "0"],
        ["demo", "--max-tokens", "0"],
        ["demo", "--engine", "tiny"],
        ["bench", "nothing"],
        ["bench"],
        ["frobnicate"],
        ["up", "--args", "not json"],
        ["up", "--args", "[1]"],
        ["up", "--args", '{"bogus": 1}'],
        ["up", "--args", '{"shards": 0}'],
        ["down", "--what"],
        ["up", "--args", '{"api_key": "sk-old-single-key"}'],
        ["up", "--tenants", "/nonexistent/tenants.yaml"],
        ["up", "--tenants", "/t.yaml", "--args", '{"tenants_file": "/t.yaml"}'],
        ["up", "--args", '{"tenants_file": "relative.yaml"}'],
        ["up", "--args", "@/nonexistent/args.json"],
        ["up", "--args", "@/"],
        ["demo", "--engine", "reference", "--gpu"],
    ],
)
def test_bad_arguments_exit_with_usage(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_a_subcommand_error_prints_that_subcommand_s_usage(capsys):
    with pytest.raises(SystemExit):
        main(["up", "--args", "[1]"])
    err = capsys.readouterr().err
    assert err.startswith("usage: kvfabric up ") and "kvfabric up: error: --args" in err, err


def test_up_refuses_bad_app_args_before_importing_vllm():
    """Arguments are checked where they come in, at once: not after vLLM's import."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from kvfabric.deploy.cli.main import main\n"
        "try:\n"
        "    main(['up', '--args', '{\"replicas\": -1}'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 2, e.code\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
        "assert 'ray.serve.llm' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (
        out.stdout.strip() == "ok"
        and "replicas: Input should be greater than or equal to 0" in out.stderr
    ), out.stderr


def test_help_and_version_exit_zero_and_say_what_they_list(capsys):
    from kvfabric.deploy.cli.main import BENCHES

    import kvfabric

    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in BENCHES), out
    for argv in (["--version"], ["up", "--help"], ["down", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0, argv
    out = capsys.readouterr().out
    assert f"kvfabric {kvfabric.__version__}" in out and "Deploy the fabric" in out


def test_app_args_from_a_file(tmp_path):
    from kvfabric.deploy.cli.main import read_app_args

    f = tmp_path / "args.json"
    f.write_text('{"replicas": 2, "block_size": 64}')
    assert (
        read_app_args(f"@{f}")
        == read_app_args('{"replicas": 2, "block_size": 64}')
        == {"replicas": 2, "block_size": 64}
    )
    f.write_text("[2]")
    with pytest.raises(ValueError, match="args.json must be a JSON object"):
        read_app_args(f"@{f}")
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="args.json"):
        read_app_args(f"@{f}")
    with pytest.raises(SystemExit) as e:  # a bad file's args fail before any cluster is reached
        main(["up", "--engine", "vllm", "--args", f"@{f}"])
    assert e.value.code == 2


def test_up_config_takes_a_yaml_llm_config_and_refuses_bad_ones(tmp_path):
    """`up --config FILE`: the user's own LLMConfig as YAML, read into the app args; a file
    that is not a mapping, or one given twice, fails before any cluster is reached."""
    from kvfabric.deploy.cli.main import read_llm_config

    good = tmp_path / "llm.yaml"
    good.write_text(
        "model_loading_config:\n  model_id: my-llama\n  model_source: org/llama\n"
        "engine_kwargs:\n  tensor_parallel_size: 2\n"
    )
    assert read_llm_config(str(good)) == {
        "model_loading_config": {"model_id": "my-llama", "model_source": "org/llama"},
        "engine_kwargs": {"tensor_parallel_size": 2},
    }
    bad = tmp_path / "bad.yaml"
    for text in ("- a\n- b\n", "key: [unclosed\n", ""):
        bad.write_text(text)
        with pytest.raises(ValueError, match="bad.yaml"):
            read_llm_config(str(bad))
    for argv in (
        ["up", "--config", str(bad)],
        ["up", "--config", str(tmp_path / "missing.yaml")],
        ["up", "--engine", "reference", "--config", str(good)],
        ["up", "--config", str(good), "--args", '{"llm_config": {}}'],
        ["up", "--config", str(good), "--args", '{"replicas": 2}'],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv


def test_status_renders_each_node_and_an_unreachable_one():
    from kvfabric.deploy.cli.status import FabricStatus, NodeStatus, PoolFill, as_json, render

    up = NodeStatus(
        "kvf-node-a",
        True,
        (PoolFill("full", "device", 3, 64), PoolFill("swa", "device", 1, 16)),
        lookups=4,
        lookup_pages=10,
        hit_pages_device=4,
        hit_pages_host=1,
        inserted_pages=7,
        fetched_bytes=3 << 20,
        engines=1,
    )
    fabrics = [FabricStatus("kvfabric.abc", ("m",), (up, NodeStatus("kvf-node-b", False)))]
    text = render(fabrics)
    assert "fabric kvfabric.abc: 2 nodes; models: m" in text
    assert "3/64" in text and "1/16" in text and "50.0%" in text and "3.0" in text
    assert "kvf-node-b" in text and "unreachable" in text
    (doc,) = as_json(fabrics)
    assert doc["nodes"][0]["hit_rate"] == 0.5 and doc["nodes"][1]["reachable"] is False
    assert render([]).startswith("no fabric")


def test_address_auto_is_refused_where_several_clusters_run(tmp_path, monkeypatch):
    """`--address auto` is Ray's pick of the cluster started last; with several on the
    machine, up/down/status refuse it and name the clusters instead of acting on one."""
    from kvfabric.deploy.harness import cluster

    for pid, session in ((11, "session_a"), (12, "session_b"), (13, None)):
        (tmp_path / str(pid)).mkdir()
        args = (
            [b"/x/ray/core/src/ray/gcs/gcs_server", b"--gcs_server_port=0"]
            + [f"--stdout_filepath=/tmp/ray/{session}/logs/gcs_server.out".encode()]
            if session
            else [b"/usr/bin/python3", b"-c", b"gcs_server"]
        )
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(args) + b"\0")
    (tmp_path / "self").mkdir()
    assert cluster.local_sessions(tmp_path) == ["session_a", "session_b"]
    monkeypatch.setattr(cluster, "local_sessions", lambda: ["session_a", "session_b"])
    with pytest.raises(SystemExit, match="2 Ray clusters run on this machine"):
        cluster.connect("auto")


def test_the_readme_documents_every_setting_users_give():
    """README "Configuration" lists each FabricSettings field a deployer sets, with its
    default (the per-replica, test and chaos ones are not theirs to set)."""
    import dataclasses
    import re
    from pathlib import Path

    from kvfabric.deploy.vllm.connector.jobs import FabricSettings

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = {
        name: default
        for names, default in re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", section, re.M)
        for name in re.findall(r"`(\w+)`", names)
    }
    internal = {
        "ray_address",
        "node_actor",
        "engine_slot",
        "step_hook",
        "step_hook_arg",
        "node_hooks",
    }
    for f in dataclasses.fields(FabricSettings):
        if f.name in internal:
            continue
        assert f.name in rows, f"README Configuration lacks {f.name}"
        shown = rows[f.name].strip().strip('"')
        assert shown.lower() == str(f.default).lower() or (shown == "" and f.default == ""), f.name


def test_the_production_apps_import_nothing_of_the_chaos_harness():
    """The Serve apps and the connector load without kvfabric.deploy.chaos: a run that
    asks for chaos (`chaos=True`, a `chaos_file`) takes the injectors the chaos harness
    registered on its import, and without it is refused."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import kvfabric.deploy.reference.serve.app, kvfabric.deploy.vllm.serve.serve_llm\n"
        "import kvfabric.deploy.vllm.connector\n"
        "from kvfabric.deploy.reference.serve.app import AppArgs\n"
        "assert AppArgs().node_config().hooks is None\n"
        "assert not [m for m in sys.modules if m.startswith('kvfabric.deploy.chaos')]\n"
        "from kvfabric.deploy.serving.injectors import NoInjectors\n"
        "try:\n"
        "    AppArgs(chaos=True).node_config()\n"
        "    raise AssertionError('chaos without the harness')\n"
        "except NoInjectors:\n"
        "    pass\n"
        "import kvfabric.deploy.chaos\n"
        "assert AppArgs(chaos=True).node_config().hooks is not None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]
