"""How far a TP=2 engine's KV is from a TP=1 engine's, against how far one TP=1 engine's
KV of a prompt is from itself when it computes the prompt in another batch.

The fabric shares pages between engines of one model split differently (pages hold every
KV head). A TP=2 engine's all-reduce sums partial products in another order than a TP=1
engine's matmul, so its KV is not bitwise the TP=1 engine's. This measures by how much,
against the limit the engine itself sets: vLLM's own prefix cache serves a prompt's KV
computed in whatever batch came first, and that KV differs too. One vLLM CPU engine of
each kind on one Ray node, the bundled tiny model (fp32); the prompt computed three ways,
each under a salt of its own, then read back from the node's pools page for page:
  alone      TP=1, the prompt by itself (the reference);
  batched    TP=1, the prompt beside another prompt;
  resumed    TP=1, its first half from vLLM's own prefix cache, the rest computed;
  tp2        TP=2 (two worker processes, one core each), the prompt by itself.
Printed per layer: max |difference| from `alone` and the share of elements that differ;
`ratio_max_abs` = tp2's max |difference| over the larger of batched's and resumed's (the
engine's own variation; 1.0: no further). Greedy outputs of all are compared too.
Run: .venv/bin/kvfabric bench tp-drift [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench tp-drift", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    import ray
    import torch
    from kvfabric.actors.directory import node_actor_name
    from kvfabric.actors.launch import running
    from kvfabric.actors.served import fabrics_of
    from kvfabric.deploy.harness.cluster import down
    from kvfabric.deploy.vllm.connector import kv_transfer_config
    from kvfabric.deploy.vllm.serve.model import ensure_tiny_model
    from ray.cluster_utils import Cluster
    from vllm import LLM, SamplingParams

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    ray.init(address=cluster.address, log_to_driver=False)
    engines = []
    try:
        here = node_actor_name(ray.get_runtime_context().get_node_id())
        model = str(ensure_tiny_model(say=lambda m: print(m, file=sys.stderr)))
        kw = dict(
            enforce_eager=True,
            seed=0,
            max_model_len=2048,
            block_size=32,
            kv_cache_memory_bytes=12 << 20,
            dtype="float32",
            kv_transfer_config=kv_transfer_config(here, cluster.address, shards=1),
        )
        one = LLM(model=model, served_model_name="tp1", **kw)
        engines.append(one)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        two = LLM(model=model, served_model_name="tp2", tensor_parallel_size=2, **kw)
        engines.append(two)
        (namespace,) = fabrics_of("tp1")
        fab = running(namespace)
        assert fab is not None and fabrics_of("tp2") == [namespace]
        node = fab.nodes[here]
        prompt = "".join("abcdefgh ijklmnopq rst"[(i * 7 + i // 5) % 22] for i in range(1200))
        other = "".join("zyxw vuts"[(i * 5 + i // 3) % 9] for i in range(900))
        greedy = SamplingParams(temperature=0, max_tokens=8)

        def ask(llm, salt: str, beside: str | None = None):
            items = [{"prompt": prompt, "cache_salt": salt}]
            if beside is not None:
                items.insert(0, {"prompt": beside, "cache_salt": salt})
            return llm.generate(items, greedy, use_tqdm=False)[-1]

        outs = {"alone": ask(one, "alone"), "batched": ask(one, "batched", other)}
        # vLLM's own prefix cache: the prompt's first half cached by an earlier request,
        # the rest computed against it (half a prompt: whole pages, vLLM's hit unit).
        half = len(one.get_tokenizer().encode(prompt)) // 64 * 32
        one.generate(
            [
                {
                    "prompt_token_ids": one.get_tokenizer().encode(prompt)[:half],
                    "cache_salt": "resumed",
                }
            ],
            greedy,
            use_tqdm=False,
        )
        outs["resumed"] = ask(one, "resumed")
        outs["tp2"] = ask(two, "tp2")
        tokens = list(outs["alone"].prompt_token_ids)

        def pages(salt: str):
            deadline = time.monotonic() + 30
            while True:  # the saves are stored as the engines step
                hit = ray.get(node.get.remote(tokens, f"salt/{salt}"), timeout=30)
                if hit.tokens or time.monotonic() > deadline:
                    return hit
                time.sleep(0.2)

        ref = pages("alone")
        report: dict = {"tokens": ref.tokens, "outputs_equal": True, "layers": []}
        worst = {"batched": 0.0, "resumed": 0.0, "tp2": 0.0}
        for name in worst:
            hit = pages(name)
            report["outputs_equal"] &= list(outs[name].outputs[0].token_ids) == list(
                outs["alone"].outputs[0].token_ids
            )
            for i, (x, y) in enumerate(zip(ref.layers, hit.layers)):
                n = min(x.shape[1], y.shape[1])
                d = (x[:, -n:] - y[:, -n:]).abs()
                row = {
                    "against": name,
                    "layer": i,
                    "max_abs": float(d.max()),
                    "differing": round(float((d > 0).float().mean()), 4),
                    "bitwise_equal": bool(torch.equal(x[:, -n:], y[:, -n:])),
                }
                report["layers"].append(row)
                worst[name] = max(worst[name], row["max_abs"])
        report["max_abs_batched"] = worst["batched"]
        report["max_abs_tp2"] = worst["tp2"]
        report["ratio_max_abs"] = (
            round(worst["tp2"] / worst["batched"], 3) if worst["batched"] else None
        )
        for row in report["layers"]:
            print(
                f"{row['against']:>8} layer {row['layer']}: max |diff| {row['max_abs']:.3g}, "
                f"{row['differing']:.1%} of elements differ"
            )
        print(
            f"tp2 / engine's own max |diff|: {report['ratio_max_abs']}; greedy outputs equal: "
            f"{report['outputs_equal']}"
        )
        if args.json:
            print(json.dumps(report))
        return 0
    finally:
        for llm in engines:
            llm.llm_engine.engine_core.shutdown()
        down()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
