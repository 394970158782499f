#!/usr/bin/env bash
# Transport, model and vLLM checks with CUDA, for a machine with a GPU (none on the dev hosts).
# Runs the transport tests and the benchmark with every pool in device memory (VRAM
# registered with NIXL/UCX, LocalTransport copies through pinned memory on a side
# stream), the vLLM connector's block copies between VRAM and host staging, and, when
# vLLM's CUDA build is installed (pip install '.[vllm]'), the vLLM demo with its
# engines on the GPU; each under a hard time limit, whole script under 10 minutes.
# Usage: benchmarks/gpu_check.sh [output-dir]     (from the repository root)
# On a bare GPU machine (a python with CUDA torch but no Ray or vLLM, NIXL installed by
# hand), run it as PY=python3 PYTHONPATH=$PWD benchmarks/gpu_check.sh: the object store's
# column and the steps that need vLLM say they were skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-${OUT:-/tmp/kvf-gpu-check}}
mkdir -p "$OUT"
export KVF_TEST_DEVICE=cuda
export NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}

"$PY" - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch
assert torch.cuda.is_available(), "CUDA is not available: this script needs a GPU"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
from kvfabric.transport import nixl_transport as nt
print("nixl bindings", nt._nb.__name__, "VRAM ok")
PY

echo "== transport tests (KVF_TEST_DEVICE=cuda)"
timeout 100 "$PY" -m pytest -q -p no:cacheprovider tests/transport/test_nixl_transport.py \
    2>&1 | tee "$OUT/tests.txt"

echo "== transport benchmark (KVF_TEST_DEVICE=cuda)"
NO_RAY=$("$PY" -c "import ray" 2>/dev/null || echo --no-object-store)
timeout 170 "$PY" -m benchmarks.transport_bench --json $NO_RAY 2>&1 | tee "$OUT/bench.txt"
tail -n 1 "$OUT/bench.txt" > "$OUT/bench.json"
echo "== reference model on CUDA: cached greedy output equals uncached (one GPU, fp32)"
timeout 60 "$PY" - <<'PY' 2>&1 | tee "$OUT/model.txt"
import torch
from kvfabric.deploy.reference.engine import Engine
from kvfabric.deploy.reference.model import ModelConfig, TinyLM
from kvfabric.fabric import NodeCache, PoolCapacity, PoolName
cfg = ModelConfig()
model = TinyLM(cfg, "cuda")
layout = cfg.layout()
cache = NodeCache(layout, {PoolName.FULL: PoolCapacity(256, 256), PoolName.SWA: PoolCapacity(64, 64)}, device="cuda")
cached, plain = Engine(model, cache), Engine(model, None)
prompt = [(7 * i) % cfg.vocab for i in range(200)]
cached.generate(prompt, 4)
a = cached.generate(prompt + [3, 4, 5], 4, return_logits=True)
b = plain.generate(prompt + [3, 4, 5], 4, return_logits=True)
assert a.cached_tokens > 0 and a.tokens == b.tokens, (a, b)
assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), "logits differ on CUDA"
print("cuda model ok: cached", a.cached_tokens, "tokens, outputs equal bit for bit")
PY
echo "== vLLM connector: blocks in VRAM <-> host staging, every backend format"
rc=0
timeout 60 "$PY" -m pytest -q -p no:cacheprovider -rs tests/deploy/vllm/connector/test_block_format.py 2>&1 | tee "$OUT/block_format.txt" || rc=$?
[ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"       # 5: the module skipped whole (no vLLM here)

echo "== vLLM demo with engines on the GPU (two simulated nodes share it)"
if "$PY" -c "from vllm.platforms import current_platform as p; raise SystemExit(0 if p.is_cuda() else 1)" 2>/dev/null; then
    HF_HUB_OFFLINE=1 timeout 420 "$PY" -m kvfabric.deploy.cli.main demo --gpu --requests 30 --json \
        --plot "$OUT/demo.png" 2>&1 | tee "$OUT/demo.txt"
    tail -n 1 "$OUT/demo.txt" > "$OUT/demo.json"
else
    echo "skipped: vLLM's CUDA build is not installed here (pip install '.[vllm]')" | tee "$OUT/demo.txt"
fi
echo "results in $OUT"
