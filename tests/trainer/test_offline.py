"""The warm start's length-grouped batches: every rollout trained on once per epoch, batches of
equal token budgets, and far less padding than random batches of the same rollouts."""

from __future__ import annotations

import random
from collections import Counter
from itertools import islice

import torch

from vllm_specrl.trainer.offline import length_grouped_batches, training_batches


def _rollouts(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """RL-shaped lengths: a prompt of ~50 tokens and answers from a few tokens to a 256-token cap."""
    rng = random.Random(seed)
    return [{"token_ids": torch.zeros(50 + min(256, int(rng.expovariate(1 / 110)) + 4), dtype=torch.long),
             "id": torch.tensor(i)} for i in range(n)]


def _padding(batches: list[list[dict]]) -> float:
    rows = sum(len(b) * max(len(f["token_ids"]) for f in b) for b in batches)
    return 1 - sum(len(f["token_ids"]) for b in batches for f in b) / rows


def _epochs(items: list[dict], batches) -> list[list[list[dict]]]:
    """Split the endless stream into epochs (each epoch covers every item once)."""
    out, epoch, seen = [], [], 0
    for b in batches:
        epoch.append(b)
        seen += len(b)
        if seen == len(items):
            out.append(epoch)
            if len(out) == 2:
                return out
            epoch, seen = [], 0
        assert seen <= len(items), "a batch spans two epochs"
    return out


def test_every_epoch_trains_every_rollout_once() -> None:
    items = _rollouts(300)
    for epoch in _epochs(items, length_grouped_batches(items, 8, random.Random(1))):
        counts = Counter(int(f["id"]) for b in epoch for f in b)
        assert set(counts) == set(range(300)) and max(counts.values()) == 1


def test_batches_hold_equal_token_budgets() -> None:
    """Long answers come fewer to a batch, short ones more, so a token weighs about the same in
    every step's mean loss, as in random batches of the same count."""
    items = _rollouts(648)
    mean = sum(len(f["token_ids"]) for f in items) / len(items)
    batches = list(islice(length_grouped_batches(items, 8, random.Random(4)), 200))
    padded = [len(b) * max(len(f["token_ids"]) for f in b) for b in batches]
    assert max(padded) <= 8 * mean
    assert sum(padded) / len(padded) > 0.85 * 8 * mean  # no crowd of small batches
    sizes = [len(b) for b in batches]
    assert min(sizes) <= 5 and max(sizes) >= 12
    assert 7 <= sum(sizes) / len(sizes) <= 9.5


def test_grouped_batches_pad_far_less_than_random_ones() -> None:
    items = _rollouts(648)
    rng = random.Random(2)
    grouped = list(islice(length_grouped_batches(items, 8, rng), 300))
    shuffled = [rng.sample(items, 8) for _ in range(300)]
    assert _padding(shuffled) > 0.3
    assert _padding(grouped) < 0.05


def test_batch_order_is_not_sorted_by_length() -> None:
    """The sort stays inside a megabatch: batch lengths over an epoch are not monotone, so the draft
    does not see all long answers, then all short ones."""
    items = _rollouts(648)
    longest = [max(len(f["token_ids"]) for f in b)
               for b in islice(length_grouped_batches(items, 8, random.Random(3)), 81)]
    rises = sum(b > a for a, b in zip(longest, longest[1:]))
    assert 20 < rises < 60


def test_training_batches_group_by_length_only_when_asked() -> None:
    """What the warm start and ``bench_draft_budget`` train on: grouped batches with
    ``group_by_length``, else ``batch_size`` distinct rollouts drawn at random each step."""
    items = _rollouts(648)
    random_ones = list(islice(training_batches(items, 8, random.Random(5)), 300))
    assert all(len({int(f["id"]) for f in b}) == 8 for b in random_ones)
    assert _padding(random_ones) > 0.3
    grouped = list(islice(training_batches(items, 8, random.Random(5), group_by_length=True), 300))
    want = list(islice(length_grouped_batches(items, 8, random.Random(5)), 300))
    assert [[int(f["id"]) for f in b] for b in grouped] == [[int(f["id"]) for f in b] for b in want]
