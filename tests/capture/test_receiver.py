"""Assembling a request's rows: prefix-cached starts, commits in the middle, recomputed rows."""

import math

import torch

from vllm_specrl.capture.receiver import RequestRows, SequenceAssembler

H = 2


def frame(positions, version, prompt_len=None, logprob=-0.5, next_ids=None):
    n = len(positions)
    header = {"request_id": "r", "positions": list(positions), "token_ids": [100 + p for p in positions],
              "next_token_ids": next_ids or [101 + p for p in positions], "policy_version": version}
    if prompt_len is not None:
        header["num_prompt_tokens"] = prompt_len
    tensors = {"aux_hidden": torch.full((n, 3 * H), float(version)), "final_hidden": torch.zeros(n, H),
               "logprobs": torch.tensor([logprob if p >= (prompt_len or 0) - 1 else math.nan
                                         for p in positions]),
               "topk_logprobs": torch.full((n, 4), -1.0), "topk_ids": torch.zeros(n, 4, dtype=torch.int32)}
    return header, tensors


def test_a_prefix_cached_request_trains_from_its_first_captured_row():
    """A GRPO sibling whose first 256 prompt tokens came from the cache: rows start at 256."""
    rows = RequestRows()
    rows.add(*frame(range(256, 300), 1, prompt_len=280))
    assert rows.contiguous_prefix() == 0
    seq = rows.sequence(version=1)
    assert seq["start"] == 256 and len(seq["token_ids"]) == 44
    assert seq["token_ids"][0] == 356 and seq["first_draft"] == 279 - 256
    assert "topk_logprobs" in seq and torch.isnan(seq["topk_logprobs"][: seq["first_draft"]]).all()


def test_a_request_spanning_a_commit_keeps_the_rows_of_the_current_version():
    rows = RequestRows()
    rows.add(*frame(range(0, 20), 1, prompt_len=8))
    rows.add(*frame(range(20, 40), 2))
    seq = rows.sequence(version=2)
    assert seq["start"] == 20 and len(seq["token_ids"]) == 20 and seq["first_draft"] == 0
    assert (seq["aux_hidden"] == 2.0).all()
    old = rows.sequence(version=1)
    assert old["start"] == 0 and len(old["token_ids"]) == 20
    assert len(rows.sequence()["token_ids"]) == 40  # no version asked: everything


def test_rows_recomputed_after_a_commit_keep_old_targets_and_are_not_trained_as_new():
    """After a commit, in-flight requests are recomputed under the new weights: new hidden states,
    but the tokens (and their logprobs) were sampled from the old policy."""
    rows = RequestRows()
    rows.add(*frame(range(0, 16), 1, prompt_len=6))
    rows.add(*frame(range(0, 16), 2, prompt_len=6, logprob=math.nan))  # recomputed prefill
    rows.add(*frame(range(16, 30), 2, prompt_len=6))                  # sampled under v2
    seq = rows.sequence(version=2)
    assert seq["start"] == 16 and len(seq["token_ids"]) == 14
    assert rows.sequence(version=3)["token_ids"].numel() == 0


def test_assembler_pops_by_version():
    asm = SequenceAssembler()
    asm.add(*frame(range(0, 10), 4, prompt_len=3))
    seq = asm.pop("r", version=5)
    assert seq["token_ids"].numel() == 0 and "r" not in asm.requests
