"""Calibration: the trainer's completion-only estimate equals what vLLM serves.

Tiny fixture, float32, T=1, k=3, probabilistic drafting, the warm-started
reduced-vocabulary draft. The engine generates rollouts and counts
``vllm:spec_decode_num_accepted_tokens_per_pos``; the trainer, given the same
rollouts (speculation is lossless, so they are samples of the target), its own
HF features and the draft, estimates those counters
(``served_accept_pos{j}``). They must agree within 0.05 per position over
thousands of drafts. The naive estimates (every position, prompt included;
chained per-step means) are reported beside it in the benchmark table.
"""

import json

import pytest

from prompts import code_prompts
from vllm_specrl.trainer.estimate_check import estimate_from_rollouts, estimate_mtp_from_rollouts, serve_rollouts

K = 3
NUM_PROMPTS = 96
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def served(tiny_model, warm_draft):
    prompts = code_prompts(300 + NUM_PROMPTS)[300:]   # held out: the warm start trained on prompts 200..263
    return serve_rollouts(tiny_model, warm_draft, prompts, K, "float32", MAX_TOKENS, ignore_eos=True,
                          chat=False, max_num_seqs=32)


@pytest.fixture(scope="module")
def estimate(tiny_model, warm_draft, served):
    return estimate_from_rollouts(tiny_model, warm_draft, served["sequences"], served["prompt_lengths"], K)


def test_served_per_position_acceptance_matches_the_trainer_estimate(served, estimate):
    sd = served["spec_decode"]
    assert sd["num_drafts"] > 1500, sd
    got = sd["per_position_acceptance"]
    want = estimate["served"]
    assert len(got) == K
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.05, {"served": got, "estimate": want}
    assert abs(sd["acceptance_length"] - estimate["served_acceptance_length"]) < 0.1
    # The estimate's draft count is the engine's (same rollouts, its expected draft starts).
    assert abs(estimate["served_drafts"] - sd["num_drafts"]) / sd["num_drafts"] < 0.05
    print(json.dumps({"vllm_counters": got, **estimate}))


@pytest.fixture(scope="module")
def served_mtp(mimo_model):
    """The tiny-mimo target's own MTP layer served at k = 3 (``"method": "mtp"``)."""
    prompts = code_prompts(300 + NUM_PROMPTS)[300:]
    return serve_rollouts(mimo_model, None, prompts, K, "float32", MAX_TOKENS, ignore_eos=True, chat=False,
                          max_num_seqs=32)


def test_the_mtp_estimate_from_an_hf_forward_matches_what_vllm_serves(mimo_model, served_mtp):
    """``estimate_mtp_from_rollouts`` (the body's HF states, not the capture path) agrees with vLLM's
    counters at every draft position of the policy's own MTP layer, drafts chained on its output."""
    sd = served_mtp["spec_decode"]
    assert sd["num_drafts"] > 1000, sd
    est = estimate_mtp_from_rollouts(mimo_model, served_mtp["sequences"], served_mtp["prompt_lengths"], K)
    got, want = sd["per_position_acceptance"], est["served"]
    assert len(got) == K
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.05, {"served": got, "estimate": want}
    assert abs(est["served_drafts"] - sd["num_drafts"]) / sd["num_drafts"] < 0.05
