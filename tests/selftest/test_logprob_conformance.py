"""The self-test's logprob conformance judgement (``selftest.run``): the returned logprobs of sampled
tokens and of prompts against plain vLLM's and an HF forward's scores of the same sequences, within a
bound a lossy path breaks; a skipped check is neither passed nor failed in the table. No engine."""

from __future__ import annotations

import pytest

from vllm_specrl.selftest.run import LOGPROB_TOLERANCE, Check, _largest_gap, _logprob_check, format_table


def found(shift: float = 0.0, prompt_shift: float = 0.0, drafts: int = 5) -> dict:
    return {"spec_decode": {"num_drafts": drafts}, "logprobs": [{"prompt_ids": [1, 2, 3], "token_ids": [4, 5],
                          "logprobs": [-1.0 + shift, -2.0 + shift],
                          "prompt_logprobs": [None, -3.0 + prompt_shift, -0.5 + prompt_shift]}]}


REFERENCE = [[None, -3.0, -0.5, -1.0, -2.0]]


def test_equal_logprobs_pass_and_the_gaps_are_split_by_kind():
    assert _largest_gap(found()["logprobs"], REFERENCE) == (0.0, 0.0)
    assert _largest_gap(found(0.1)["logprobs"], REFERENCE) == (pytest.approx(0.1), 0.0)
    assert _largest_gap(found(0.0, 0.2)["logprobs"], REFERENCE)[1] > 0.19
    assert _logprob_check("EAGLE-3 logprobs = plain", found(LOGPROB_TOLERANCE / 2), REFERENCE, REFERENCE).passed


def test_a_lossy_path_fails_against_either_reference():
    assert not _logprob_check("x", found(0.05), REFERENCE, REFERENCE).passed
    assert not _logprob_check("x", found(), REFERENCE, [[None, -3.0, -0.5, -1.0, -2.1]]).passed  # HF disagrees
    assert not _logprob_check("x", found(0.0, 0.05), REFERENCE, REFERENCE).passed  # prompt logprobs
    assert not _logprob_check("x", {"error": "engine died"}, REFERENCE, REFERENCE).passed
    assert not _logprob_check("x", found(drafts=0), REFERENCE, REFERENCE).passed  # nothing speculative was checked
    assert _logprob_check("x", found(), REFERENCE, None).passed  # no HF forward: plain vLLM alone judges


def test_a_skipped_check_is_counted_apart():
    table = format_table([Check("a", True, "ok"), Check("b", True, "no sleep mode here", skipped=True),
                          Check("c", False, "bad")])
    assert "SKIP" in table and "selftest: 1 passed, 1 failed, 1 skipped" in table
