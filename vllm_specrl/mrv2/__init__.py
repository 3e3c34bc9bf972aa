"""The port to Model Runner V2, vLLM 0.34's only runner: speculative methods registered through vLLM's
public speculator interface instead of patches on the V1 runner (docs/vllm-0.34-port-map.md). Written
against vLLM 0.34.0's source and checked against it without running (no vLLM build that runs Model Runner
V2 runs on the project's machines); ``capture_view`` and ``history_speculator`` are tested on any vLLM."""
