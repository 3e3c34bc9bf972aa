"""Exact sampling for speculative steps: the samplers (``exact``), their vLLM-shaped entry points
(``cpu_samplers``) and the CPU patches that bind them (``cpu_patches``)."""
