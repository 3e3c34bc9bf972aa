"""What a trainer calls: ``EngineClient`` (one ``vllm serve``), ``FleetClient`` (replicas,
all or none), ``EngineGroup`` (vLLM's native protocol over N engines), and commits
into an in-process ``LLM``."""
