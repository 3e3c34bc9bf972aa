"""Verifiable tasks for the demo GRPO loop: prompts and the rewards checked by code.

``arithmetic``: "What is a + b? Answer with just the number." SmolLM2-135M answers
in a few tokens, so completions are nearly all the same length: no tail.
``explain``: "... Explain your reasoning briefly, then give the answer." Answers run
from a dozen to a couple of hundred tokens and stop at EOS, so every step ends with
a small-batch tail of the longest completions, as RL rollouts on reasoning tasks do.
``concise``: the ``explain`` prompts, rewarded for a right conclusion and for brevity (half each): RL
then changes what the policy writes (shorter answers, other wording), so a draft built on the
starting policy's answers can go stale. ``concise-minus``: the same reward on "What is a - b?", a
second task for a run that switches task part way (``TaskSchedule``).
Prompts of ``HELD_OUT_PAIRS`` never appear in a ``concise`` step: they measure the policy's drift.
"""

from __future__ import annotations

import random
import re

TASKS = ("arithmetic", "explain", "concise", "concise-minus")

_SUFFIX = {"arithmetic": "Answer with just the number.",
           "explain": "Explain your reasoning briefly, then give the answer.",
           "concise": "Explain your reasoning briefly, then give the answer.",
           "concise-minus": "Explain your reasoning briefly, then give the answer."}
CONCISE_WORDS = 25  # the word budget of a ``concise`` answer
# (a, b) pairs kept out of the ``concise`` tasks' steps: the fixed prompts the policy's drift is measured on
HELD_OUT_PAIRS = ((1, 8), (2, 5), (3, 9), (4, 4), (5, 7), (6, 2), (7, 6), (9, 3))


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
    while len(out) < n:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if task.startswith("concise") and (a, b) in HELD_OUT_PAIRS:
            continue
        if task == "concise-minus":
            a, b = max(a, b), min(a, b)
        out.append((_prompt(a, b, task), a - b if task == "concise-minus" else a + b))
    return out


def held_out_prompts(task: str = "concise") -> list[str]:
    """The prompts of ``HELD_OUT_PAIRS`` in ``task``'s wording (none of them in a ``concise`` step)."""
    return [_prompt(a, b, task) for a, b in HELD_OUT_PAIRS]


class TaskSchedule:
    """Step i's tasks and reward: ``task`` before ``switch_at``, ``switch_task`` from it on (a second task
    part way through a run, as multi-stage RL does), each step's prompts fixed by (seed, step)."""

    def __init__(self, task: str, prompts: int, seed: int, switch_task: str | None = None,
                 switch_at: int | None = None, dataset_size: int | None = None):
        for name in (task, switch_task):
            if name is not None and name not in TASKS:
                raise ValueError(f"unknown task {name!r}; choose from {TASKS}")
        if (switch_task is None) != (switch_at is None):
            raise ValueError("a switch needs both switch_task and switch_at")
        self.task, self.prompts, self.seed = task, prompts, seed
        self.switch_task, self.switch_at, self.dataset_size = switch_task, switch_at, dataset_size

    def task_at(self, step: int) -> str:
        return self.switch_task if self.switch_at is not None and step >= self.switch_at else self.task

    def tasks(self, step: int) -> list[tuple[str, tuple[str, int]]]:
        """Step ``step``'s (prompt, (task, answer)) pairs: the answer carries its task for ``score``."""
        task = self.task_at(step)
        return [(p, (task, a)) for p, a in make_tasks(step, self.prompts, self.seed, task, self.dataset_size)]

    @staticmethod
    def score(text: str, task_and_answer: tuple[str, int]) -> float:
        task, answer = task_and_answer
        return reward(text, answer, task)


def distinct_prompts(n: int, seed: int, task: str = "explain") -> list[str]:
    """Up to ``n`` different prompts of an RL task, in an order fixed by ``seed``: what a
    draft is warm-started on before RL over this task (the task has 81 prompts in all)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {TASKS}")
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(seed).shuffle(pairs)
    return [_prompt(a, b, task) for a, b in pairs[:n]]


def _prompt(a: int, b: int, task: str) -> str:
    return f"What is {a} {'-' if task == 'concise-minus' else '+'} {b}? {_SUFFIX[task]}"


def answer_style(text: str) -> dict[str, float]:
    """What RL changes in an answer, per answer: its words, and whether it states an equation and
    says "the answer is" (``style_summary`` averages them over a step)."""
    return {"words": float(len(text.split())), "equation": float(bool(re.search(r"\d+\s*[-+]\s*\d+\s*=", text))),
            "answer_is": float("answer is" in text.lower())}


def style_summary(texts: list[str]) -> dict[str, float]:
    """Mean of ``answer_style`` over answers."""
    rows = [answer_style(t) for t in texts]
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def reward(text: str, answer: int, task: str = "arithmetic") -> float:
    """``arithmetic``: 1 when the sum is among the first three integers of the answer.
    ``explain``: 1 when the last integer of the answer is the sum (the conclusion).
    ``concise``/``concise-minus``: half for the right conclusion (the last integer), half for an answer
    of at most ``CONCISE_WORDS`` words (a format reward beside an accuracy reward, as RL recipes pair them).

    SmolLM2-135M restates the question ("2 + 5 is 7") more often than it answers
    with the number alone (the first integer is rarely the sum, which often appears
    later), so the arithmetic reward accepts it early on.
    """
    numbers = [int(x) for x in re.findall(r"-?\d+", text)]
    if task.startswith("concise"):
        right = bool(numbers) and numbers[-1] == answer
        return 0.5 * right + 0.5 * (len(text.split()) <= CONCISE_WORDS)
    if task == "explain":
        return 1.0 if numbers and numbers[-1] == answer else 0.0
    return 1.0 if answer in numbers[:3] else 0.0
