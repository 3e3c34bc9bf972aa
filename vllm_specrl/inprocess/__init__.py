"""vLLM in-process (``LLM``, ``AsyncLLM``), as verl, NeMo RL and OpenRLHF drive it: the guarantees ``vllm
serve`` gives through its routes, given through the engine object instead (docs/in-process-engines.md)."""
