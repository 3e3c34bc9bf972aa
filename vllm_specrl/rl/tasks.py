"""Verifiable tasks for the demo GRPO loop: prompts and the rewards checked by code.

``arithmetic``: "What is a + b? Answer with just the number." SmolLM2-135M answers
in a few tokens, so completions are nearly all the same length: no tail.
``explain``: "... Explain your reasoning briefly, then give the answer." Answers run
from a dozen to a couple of hundred tokens and stop at EOS, so every step ends with
a small-batch tail of the longest completions, as RL rollouts on reasoning tasks do.
"""

from __future__ import annotations

import random
import re

TASKS = ("arithmetic", "explain")

_SUFFIX = {"arithmetic": "Answer with just the number.",
           "explain": "Explain your reasoning briefly, then give the answer."}


def make_tasks(step: int, n: int, seed: int, task: str = "arithmetic",
               dataset_size: int | None = None) -> list[tuple[str, int]]:
    """``n`` (prompt, answer) pairs for one RL step, fixed by (seed, step).

    With ``dataset_size`` the prompts come from a fixed set of that many tasks, taken in
    order and from the start again once used up (epochs, as RL over a dataset runs), so
    each prompt comes back every ``dataset_size / n`` steps.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {TASKS}")
    if dataset_size:
        pool = make_tasks(0, dataset_size, seed, task)
        return [pool[(step * n + i) % dataset_size] for i in range(n)]
    rng = random.Random(seed * 1000 + step)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append((_prompt(a, b, task), a + b))
    return out


def distinct_prompts(n: int, seed: int, task: str = "explain") -> list[str]:
    """Up to ``n`` different prompts of an RL task, in an order fixed by ``seed``: what a
    draft is warm-started on before RL over this task (the task has 81 prompts in all)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {TASKS}")
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(seed).shuffle(pairs)
    return [_prompt(a, b, task) for a, b in pairs[:n]]


def _prompt(a: int, b: int, task: str) -> str:
    return f"What is {a} + {b}? {_SUFFIX[task]}"


def reward(text: str, answer: int, task: str = "arithmetic") -> float:
    """``arithmetic``: 1 when the sum is among the first three integers of the answer.
    ``explain``: 1 when the last integer of the answer is the sum (the conclusion).

    SmolLM2-135M restates the question ("2 + 5 is 7") more often than it answers
    with the number alone (the first integer is rarely the sum, which often appears
    later), so the arithmetic reward accepts it early on.
    """
    numbers = [int(x) for x in re.findall(r"-?\d+", text)]
    if task == "explain":
        return 1.0 if numbers and numbers[-1] == answer else 0.0
    return 1.0 if answer in numbers[:3] else 0.0
