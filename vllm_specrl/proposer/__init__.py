"""The draft side of speculation: the EAGLE-3 head (torch + vLLM faces) and its checkpoints."""
