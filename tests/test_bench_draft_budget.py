"""The objective names ``bench_draft_budget.py --objectives`` takes: soft CE plus terms."""

from __future__ import annotations

import pytest

from helpers import load_script
from vllm_specrl.trainer.core import TrainConfig

bench = load_script("scripts/bench/bench_draft_budget.py")


@pytest.mark.parametrize("name, expected", [
    ("ce", {}),
    ("ce+tv", {"tv_weight": 1.0}),
    ("ce+tv4", {"tv_weight": 4.0}),
    ("ce+wd0.5+tv4", {"weight_decay": 0.5, "tv_weight": 4.0}),
    ("ce+wd0.5+accept_weighted", {"weight_decay": 0.5, "accept_weighted": True}),
    ("ce+noise0.2+wd1", {"feature_noise": 0.2, "weight_decay": 1.0}),
    ("ce+wd0.5+decay1", {"weight_decay": 0.5, "decay": 1.0}),
    ("ce+anchor2", {"start_anchor": 2.0}),
])
def test_objective_terms_become_train_config_fields(name: str, expected: dict) -> None:
    overrides = bench.parse_objective(name)
    assert overrides == expected
    cfg = TrainConfig(**overrides)  # every field is one TrainConfig has
    for field, value in expected.items():
        assert getattr(cfg, field) == value


@pytest.mark.parametrize("name", ["tv", "ce+tvx", "ce+kl", "ce+accept_weighted2", "ce+wd0.1+wd0.5", "ce+"])
def test_a_malformed_objective_is_refused(name: str) -> None:
    with pytest.raises(ValueError):
        bench.parse_objective(name)
