"""``vllm-specrl selftest``: the product's promises checked on the user's own machine and vLLM.

``run`` (the command) starts each engine in a process of its own (``engine_job``: vLLM allows one
engine per process), compares what they return (``stats``: exact greedy equality, a two-sample
chi-square test per output position at temperature 1) and prints a pass/fail table.
"""
