"""Sampling parameters for warm-start rollouts: one seed per prompt, never shared across prompts.

vLLM derives the seeds of a request's ``n`` samples from its own (``seed + index``), so one
``SamplingParams(n=..., seed=s)`` for every prompt gives every prompt the same ``n`` random streams.
On a task whose prompts differ in a few tokens (``What is 3 + 7? ...`` / ``What is 9 + 9? ...``) the
rollouts then repeat each other nearly word for word across prompts: the draft trained on ``n``
answers instead of ``prompts x n``, and a held-out prompt's rollouts were near-copies of training
ones (the demo draft's held-out estimate read acceptance length 2.02 where vLLM served 1.63 on
fresh rollouts of other prompts).
"""

from __future__ import annotations

from typing import Any

# Warm-start seeds start here: an RL loop seeding its own requests from small numbers (the demo's
# ``(seed * 7919 + step) * prompts * group + ...``) must not replay the streams the draft trained on,
# or its first steps' rollouts of a trained prompt would be the training rollouts themselves.
WARM_START_SEED_BASE = 1 << 30


def per_prompt_sampling_params(prompts: int, samples: int, temperature: float, max_tokens: int,
                               seed: int) -> list[Any]:
    """``prompts`` ``SamplingParams`` whose ``samples x prompts`` sample seeds are all distinct."""
    from vllm import SamplingParams

    return [SamplingParams(n=samples, temperature=temperature, max_tokens=max_tokens,
                           seed=WARM_START_SEED_BASE + (seed * 100_003 + i) * samples)
            for i in range(prompts)]
