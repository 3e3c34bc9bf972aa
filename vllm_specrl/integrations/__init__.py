"""Adapters that let existing RL frameworks roll out and sync weights through vllm-specrl.

One module per framework, imported on demand (each needs its framework installed):
``vllm_specrl.integrations.trl`` for TRL's vLLM server mode.
"""
