"""`kvfabric demo`'s runs: the reference model's, and vLLM's (conversations, or open-loop
load with `--rate`)."""
