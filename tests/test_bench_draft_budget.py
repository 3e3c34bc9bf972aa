"""``bench_draft_budget.py``: the objective names ``--objectives`` takes (soft CE plus terms), and the
drafts ``--save-drafts`` keeps for serving.

Engines: none; one interpreter runs the script itself (two training steps on the session's tiny warm
draft's rollouts), since ``--save-drafts`` is wired through its command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from helpers import load_script
from vllm_specrl.proposer.checkpoint import load_draft
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


def test_saved_drafts_serve_and_hold_out_what_they_trained_on(tiny_model, warm_draft, tmp_path) -> None:
    """``--save-drafts``: the screened draft is saved as ``train-draft`` saves one (the checkpoint vLLM
    serves), and its metadata names the prompts it trained on, so ``bench_calibration.py`` serves it on
    held-out prompts only (the warm start's own record of its training prompts is the reference)."""
    out = tmp_path / "drafts"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/bench/bench_draft_budget.py"), "--target", str(tiny_model),
         "--rollouts", str(warm_draft / "warm_start_rollouts.json"), "--budgets", "", "--objectives", "ce+tv4",
         "--steps", "2", "--draft-vocab-size", "1024", "--save-drafts", str(out),
         "--out", str(tmp_path / "report.json")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    saved = out / "ce+tv4-s0"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["objectives"][0]["saved_to"] == str(saved)
    draft = load_draft(saved, tiny_model)
    assert draft.shape.draft_vocab_size == 1024
    calibration = load_script("scripts/bench/bench_calibration.py")
    trained = json.loads((warm_draft / "trainer_meta.json").read_text())["warm_start"]["train_prompt_texts"]
    assert trained and calibration.prompts_trained_on(saved) == set(trained)
    assert json.loads((saved / "trainer_meta.json").read_text())["config"]["tv_weight"] == 4.0
