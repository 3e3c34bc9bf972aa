"""CPU performance shortcuts: engine patches that make speculative steps cheaper on vLLM's CPU
platform (samplers, deferred draft KV, skipped draft fetches, the runner's step timer, the
start method, malloc tuning). Each is a registry patch with its own switch, installed on
the CPU platform only; ``VLLM_SPECRL_CPU_SHORTCUTS=0`` turns them all off. None changes
what is sampled. (Fixes of vLLM faults live in ``compat``.)"""
