"""A vLLM engine with the FabricConnector in a process of its own, for tests that kill it
(-9) and check what the fabric reclaims (test_engine_kill.py). Not a test.

    python -m tests.deploy.vllm.connector.engine_proc ADDRESS NODE_ACTOR FAULT_FILE

It prints one JSON line when ready ({"engine_id": ...}), then answers each JSON line on
stdin ({"prompt": str, "salt": str | null}) with one ({"tokens": [...], "cached": n}, or
{"error": "..."} and exits 1: its engine died)."""

from __future__ import annotations

import json
import os
import sys
import uuid


def main(address: str, here: str, fault_file: str) -> int:
    # Answers go to the stdout the test reads; everything else (vLLM's logs, its engine
    # core's) to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    os.environ["HF_HUB_OFFLINE"] = "1"
    from kvfabric.deploy.chaos.faults import StepFaultFile
    from kvfabric.deploy.vllm.serve.model import ensure_tiny_model
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    from tests.deploy.vllm.connector.connector_engine import MAX_TOKENS, engine_args

    events = f"ipc:///tmp/kvf-events-{uuid.uuid4().hex[:12]}"
    llm = LLM(
        model=str(ensure_tiny_model()),
        **engine_args(
            here,
            address,
            engine_slot=f"proc-{uuid.uuid4().hex[:8]}",  # its device cache in the index
            **StepFaultFile.settings(fault_file),
        ),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=events,
            replay_endpoint=events + "-replay",
        ),
    )
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    print(json.dumps({"engine_id": engine_id}), file=answers)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for line in sys.stdin:
        ask = json.loads(line)
        item = {"prompt": ask["prompt"]}
        if ask.get("salt"):
            item["cache_salt"] = ask["salt"]
        try:
            out = llm.generate([item], params, use_tqdm=False)[0]
        except Exception as e:  # the engine died under the request
            print(json.dumps({"error": repr(e)}), file=answers)
            return 1
        answer = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}
        print(json.dumps(answer), file=answers)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
