"""``scripts/bench/bench_hybrid_estimate.py``: its walk over draft starts must count what vLLM counts
(the trainer's ``served_acceptance`` is the reference), a start without a draft must yield one token,
and the history's weights must be 1 exactly where the rollout emitted what the history drafted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import load_script
from vllm_specrl.trainer.acceptance import StepAcceptance, served_acceptance


def _bench():
    return load_script("scripts/bench/bench_hybrid_estimate.py")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_walk_counts_what_the_served_estimate_counts(seed):
    rng = np.random.default_rng(seed)
    k, n, first = 3, 40, 7
    valid = np.zeros((k, n), dtype=bool)
    for j in range(k):
        valid[j, first:n - 2] = rng.random(n - 2 - first) < (1.0 if j == 0 else 0.8)
    valid[1] &= valid[0]
    valid[2] &= valid[1]
    weight = rng.random((k, n))
    got = _bench().walk(n, first, k, lambda s: (valid[:, s], weight[:, s], "eagle"))
    want = served_acceptance(StepAcceptance([torch.from_numpy(v[None]) for v in valid],
                                            [torch.from_numpy(w[None]).float() for w in weight]),
                             torch.tensor([first]))
    assert got["drafts"] == pytest.approx(want["drafts"], rel=1e-5)
    assert got["accepted"].tolist() == pytest.approx(want["accepted_per_pos"], rel=1e-5)
    # Every verify step yields its accepted tokens plus one.
    assert got["tokens"] == pytest.approx(got["steps"] + got["accepted"].sum(), rel=1e-6)


def test_a_start_without_a_draft_yields_one_token():
    k, n = 3, 20
    none = (np.zeros(k, dtype=bool), np.zeros(k), "history")
    got = _bench().walk(n, 4, k, lambda s: none)
    assert got["drafts"] == 0.0 and got["tokens"] == got["steps"] == n - 2 - 4


@pytest.mark.parametrize("mode", ["token", "sampled"])
def test_history_weights_are_one_where_the_rollout_emitted_the_draft(mode):
    """Rollout 0 repeats a kept earlier rollout (index 2) exactly: wherever the history drafts, each
    drafted step is accepted (token-id: drawn equal; sampled: q = 1 over p = 0.5). Rollout 1 (its
    sibling) goes 40 where the others went 4: the history's draft after 1 2 3 is rejected there."""
    prompt = list(range(100, 110))
    same = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    other = [1, 2, 3, 40, 50, 60, 70, 80, 90, 91, 92, 93]
    sequences = [prompt + same, prompt + other, prompt + same]
    lengths = [len(prompt)] * 3
    p_next = [np.full(len(s), 0.5) for s in sequences[:2]]
    out = _bench().history_drafts([[0, 1]], {0: [2]}, sequences, lengths, p_next, 3, [0.05], mode == "sampled")
    valid, weight = out[0.05][0]
    assert valid[0].any()
    assert np.all(weight[valid] == 1.0) and np.all(weight[~valid] == 0.0)
    valid1, weight1 = out[0.05][1]
    after_123 = len(prompt) + 1   # the start whose context ends in 1 2 3 (it drafts the token at + 3)
    assert valid1[0, after_123] and weight1[0, after_123] == 0.0
    assert weight[0, after_123] == 1.0
