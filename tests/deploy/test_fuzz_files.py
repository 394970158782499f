"""Fuzzing the decoders of files and configs (issue #6): trace files, KV layouts, app
args, model configs; the same rules as tests/actors/test_fuzz_events.py (see there)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvfabric.core.cache.layout import KVLayout, LayoutError
from kvfabric.core.cache.tiers import WritePolicy
from kvfabric.core.index.routes import MAX_SHARDS
from kvfabric.deploy.reference.model import ModelConfig, ModelConfigError
from kvfabric.deploy.reference.serve.app import AppArgs, AppArgsError
from kvfabric.deploy.sim.trace import BLOCK_TOKENS, TraceError, TraceRequest, load_trace

from tests.fuzzing import NEAR, NEAR_JSON, RANDOM, U64, _pos, _uint, flipped, fuzz, mutated

pytestmark = pytest.mark.fuzz


# --- trace files -------------------------------------------------------------------------------
TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def trace_line_ok(o: object) -> bool:
    if not (type(o) is dict and set(o) == set(TRACE_FIELDS)):
        return False
    n = o["input_length"]
    return (
        _uint(o["timestamp"])
        and _pos(n)
        and _uint(o["output_length"])
        and type(o["hash_ids"]) is list
        and all(map(_uint, o["hash_ids"]))
        and len(o["hash_ids"]) == -(-n // BLOCK_TOKENS)
    )


@st.composite
def trace_lines(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 4 * BLOCK_TOKENS))
    ids = draw(
        st.lists(
            st.integers(0, 2**63), min_size=-(-n // BLOCK_TOKENS), max_size=-(-n // BLOCK_TOKENS)
        )
    )
    return {
        "timestamp": draw(st.integers(0, 2**40)),
        "input_length": n,
        "output_length": draw(st.integers(0, 4096)),
        "hash_ids": ids,
    }


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file the trace tests rewrite per example (function-scoped tmp_path is per test)."""
    return tmp_path_factory.mktemp("trace") / "t.jsonl"


def load(path: Path, content: bytes) -> list[TraceRequest]:
    path.write_bytes(content)
    return load_trace(path)


@fuzz
@given(st.lists(trace_lines(), max_size=4))
def test_traces_round_trip_exactly(trace: Path, lines: list[dict]) -> None:
    lines.sort(key=lambda o: o["timestamp"])
    got = load(trace, "".join(json.dumps(o) + "\n" for o in lines).encode())
    assert got == [
        TraceRequest(o["timestamp"], o["input_length"], o["output_length"], tuple(o["hash_ids"]))
        for o in lines
    ]


@fuzz
@given(
    trace_lines().flatmap(lambda o: mutated(o, NEAR_JSON, st.sampled_from([*TRACE_FIELDS, "x"])))
)
def test_trace_lines_are_accepted_iff_valid(trace: Path, obj: Any) -> None:
    first = {"timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": [0]}
    try:
        got = load(trace, (json.dumps(first) + "\n" + json.dumps(obj) + "\n").encode())
    except TraceError as e:
        assert not trace_line_ok(obj) and e.line == 2, obj
        return
    assert trace_line_ok(obj)
    assert got[1] == TraceRequest(
        obj["timestamp"], obj["input_length"], obj["output_length"], tuple(obj["hash_ids"])
    )


TRACE_BYTES = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=100).map(str.encode),
    st.lists(trace_lines(), min_size=1, max_size=2)
    .map(lambda ls: "".join(json.dumps(o) + "\n" for o in ls).encode())
    .flatmap(flipped),
    st.sampled_from(
        [b"1" * 5000, b"[" * 100_000, b'{"timestamp": 1e999}', b"\xff\xfe", b"\r\r{}\n"]
    ),
)


@fuzz
@given(TRACE_BYTES)
def test_trace_bytes_load_or_raise_trace_error(trace: Path, content: bytes) -> None:
    try:
        got = load(trace, content)
    except TraceError as e:
        assert 1 <= e.line <= len(content.splitlines()) and str(e).startswith(f"t.jsonl:{e.line}: ")
        return
    assert all(isinstance(r, TraceRequest) for r in got)


# --- configs -------------------------------------------------------------------------------------
LAYOUT_FIELDS = ("layers", "kv_heads", "head_dim", "page_size", "window", "dtype")


def layout_ok(d: object) -> bool:
    if not (
        type(d) is dict
        and set(d) <= set(LAYOUT_FIELDS)
        and {"layers", "kv_heads", "head_dim", "page_size"} <= set(d)
    ):
        return False
    layers, window = d["layers"], d.get("window", 0)
    return (
        type(layers) is list
        and bool(layers)
        and all(type(k) is str and k in ("full", "swa") for k in layers)
        and all(_pos(d[f]) for f in ("kv_heads", "head_dim", "page_size"))
        and _uint(window)
        and (window > 0) == ("swa" in layers)
        and type(d.get("dtype", "float32")) is str
        and d.get("dtype", "float32") in ("float32", "float16", "bfloat16")
    )


LAYOUTS = st.builds(
    lambda layers, heads, dim, page, window, dtype: KVLayout(
        tuple(layers), heads, dim, page, window if "swa" in layers else 0, dtype
    ),
    st.lists(st.sampled_from(["full", "swa"]), min_size=1, max_size=6),
    st.integers(1, 64),
    st.integers(1, 256),
    st.integers(1, 256),
    st.integers(1, 8192),
    st.sampled_from(["float32", "float16", "bfloat16"]),
)


@fuzz
@given(LAYOUTS)
def test_layouts_round_trip_exactly(layout: KVLayout) -> None:
    out = KVLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert (
        out == layout
        and out.fingerprint == layout.fingerprint
        and out.to_dict() == layout.to_dict()
    )


@fuzz
@given(
    st.one_of(
        RANDOM,
        LAYOUTS.map(KVLayout.to_dict).flatmap(
            lambda d: mutated(d, new_keys=st.sampled_from([*LAYOUT_FIELDS, "x", 0, b"y"]))
        ),
    )
)
def test_layout_dicts_are_accepted_iff_valid(d: Any) -> None:
    try:
        layout = KVLayout.from_dict(d)
    except LayoutError:
        assert not layout_ok(d), d
        return
    assert layout_ok(d) and layout.to_dict() == {"window": 0, "dtype": "float32"} | d


APP_FIELDS = {name: f.default for name, f in AppArgs.model_fields.items()}


def app_args_ok(d: object) -> bool:
    if d is None:
        return True
    if not (type(d) is dict and set(d) <= set(APP_FIELDS)):
        return False
    a = APP_FIELDS | d
    return (
        type(a["model_name"]) is str
        and bool(a["model_name"])
        and (
            a["tenants_file"] is None
            or (type(a["tenants_file"]) is str and os.path.isabs(a["tenants_file"]))
        )
        and all(_uint(a[f]) for f in ("nodes", "host_pages"))
        and all(_pos(a[f]) for f in ("shards", "device_pages", "max_positions", "max_tokens_limit"))
        and a["shards"] <= MAX_SHARDS
        and type(a.get("chaos", False)) is bool
        and type(a["gpus_per_replica"]) in (int, float)
        and 0 <= a["gpus_per_replica"] <= 8
        and a["device_pages"] * ModelConfig().page_size >= a["max_positions"]  # pools hold a prompt
        and _uint(a["disk_pages"])
        and (
            a["disk_folder"] is None
            or (type(a["disk_folder"]) is str and os.path.isabs(a["disk_folder"]))
        )
        and (a["disk_pages"] == 0 or a["disk_folder"] is not None)
        and type(a["disk_write"]) in (str, WritePolicy)
        and a["disk_write"] in ("write_back", "write_through")
    )


APP_ARGS = st.fixed_dictionaries(
    {},
    optional={
        "model_name": st.text(min_size=1, max_size=8),
        "shards": st.integers(1, MAX_SHARDS),
        "tenants_file": st.none() | st.text(max_size=8).map(lambda s: "/" + s),
        "nodes": st.integers(0, 64),
        "device_pages": st.integers(1, 2**20),
        "host_pages": st.integers(0, 2**20),
        "max_positions": st.integers(1, 2**16),
        "max_tokens_limit": st.integers(1, 2**16),
        "chaos": st.booleans(),
        "gpus_per_replica": st.integers(0, 8) | st.floats(0, 8),
        "disk_pages": st.integers(0, 2**20),
        "disk_folder": st.none() | st.text(max_size=8).map(lambda s: "/" + s),
        "disk_write": st.sampled_from(["write_back", "write_through", "write_through_selective"]),
    },
)


@fuzz
@given(APP_ARGS.filter(app_args_ok))
def test_app_args_round_trip_exactly(d: dict) -> None:
    args = AppArgs.from_dict(json.loads(json.dumps(d)))
    assert args.as_dict() == APP_FIELDS | d
    assert AppArgs.from_dict(args.as_dict()) == args


@fuzz
@given(
    st.one_of(
        st.none(),
        RANDOM,
        APP_ARGS.flatmap(
            lambda d: mutated(
                d,
                NEAR | st.sampled_from(["t.yaml", "/t.yaml"]),
                new_keys=st.sampled_from([*APP_FIELDS, "api_key", "bogus", 1, b"shards"]),
            )
        ),
    )
)
def test_app_args_are_accepted_iff_valid(d: Any) -> None:
    try:
        args = AppArgs.from_dict(d)
    except AppArgsError:
        assert not app_args_ok(d), d
        return
    assert app_args_ok(d) and args.as_dict() == APP_FIELDS | (d or {})


MODEL_FIELDS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def model_ok(kw: dict) -> bool:
    c = MODEL_FIELDS | kw
    ints = (
        "vocab",
        "d_model",
        "n_heads",
        "kv_heads",
        "head_dim",
        "ffn",
        "page_size",
        "max_positions",
    )
    if not all(_pos(c[f]) for f in ints):
        return False
    layers = c["layers"]
    return (
        c["n_heads"] % c["kv_heads"] == 0
        and c["head_dim"] % 2 == 0
        and type(layers) in (list, tuple)
        and bool(layers)
        and all(type(k) is str and k in ("full", "swa") for k in layers)
        and _uint(c["window"])
        and (c["window"] > 0 or "swa" not in layers)
        and all(type(c[f]) in (int, float) and 0 < c[f] < math.inf for f in ("rope_base", "eps"))
        and _uint(c["seed"])
        and c["seed"] < 2**64
    )


MODEL_KWARGS = st.fixed_dictionaries(
    {},
    optional={
        "vocab": st.integers(1, 1000),
        "n_heads": st.sampled_from([2, 4, 8]),
        "kv_heads": st.sampled_from([1, 2]),
        "head_dim": st.integers(1, 32).map(lambda x: 2 * x),
        "layers": st.lists(st.sampled_from(["full", "swa"]), min_size=1, max_size=4),
        "window": st.integers(1, 64),
        "rope_base": st.floats(1.0, 1e6),
        "eps": st.floats(1e-8, 1e-2),
        "seed": U64,
    },
)


@fuzz
@given(
    MODEL_KWARGS.flatmap(
        lambda kw: st.one_of(
            st.just(kw),
            mutated(
                {"layers": ["full", "swa"]} | kw,
                NEAR | st.floats(),
                st.sampled_from(sorted(MODEL_FIELDS)),
                root=False,
            ),
        )
    )
)
def test_model_configs_are_accepted_iff_valid(kw: dict) -> None:
    try:
        config = ModelConfig(**kw)
    except ModelConfigError:
        assert not model_ok(kw), kw
        return
    assert model_ok(kw)
    want = MODEL_FIELDS | kw
    assert dataclasses.asdict(config) == want | {"layers": tuple(want["layers"])}
    assert ModelConfig(**dataclasses.asdict(config)) == config


@pytest.mark.parametrize(
    "content,reason",
    [
        (b"1" * 5000, "invalid JSON"),
        (b"[" * 100_000, "nested too deeply"),
        (b"\xff\n", "not UTF-8"),
        (
            json.dumps(
                {"timestamp": 0, "input_length": 10**400, "output_length": 0, "hash_ids": []}
            ).encode(),
            "hash_ids",
        ),
    ],
)
def test_trace_errors_that_escaped(tmp_path: Path, content: bytes, reason: str) -> None:
    with pytest.raises(TraceError, match=reason):
        load(tmp_path / "t.jsonl", content)


def test_configs_that_passed_or_escaped() -> None:
    base = {"layers": ["full"], "kv_heads": 1, "head_dim": 1, "page_size": 1}
    for bad in (
        {"window": 0.0},
        {"window": False},
        {"window": None},
        {"layers": {"full": 1}},
        {1: 2},
    ):
        with pytest.raises(LayoutError):
            KVLayout.from_dict(base | bad)
    with pytest.raises(LayoutError):
        KVLayout.from_dict(base | {"layers": ["swa"], "window": True})
    for bad in ("ab", 5, [("shards", 2)], {1: 1, "x": 2}, {"shards": MAX_SHARDS + 1}):
        with pytest.raises(AppArgsError):
            AppArgs.from_dict(bad)
    for bad in (
        {"rope_base": "x"},
        {"eps": float("nan")},
        {"seed": -1},
        {"window": True},
        {"layers": "full"},
        {"layers": (["full"],)},
        {"layers": ("moe",)},
    ):
        with pytest.raises(ModelConfigError):
            ModelConfig(**bad)
