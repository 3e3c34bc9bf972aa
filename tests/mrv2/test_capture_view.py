"""Model Runner V2's capture view: one step's committed rows read from what ``propose`` receives must be the
rows the V1 runner's view gives for the same step (the reference: per-request sampled-token lists, as the
V1 runner hands them), and the tee never lets a tap failure reach the step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_specrl.capture.tap import step_frames
from vllm_specrl.mrv2.capture_view import CaptureTee, mrv2_step_view

HIDDEN = 4


def _step():
    """Three requests: a prefill chunk that ends its prompt (slot 2), one that does not (slot 0), and a
    request verifying 3 drafts of which 1 was accepted (slot 1)."""
    ids = [10, 11, 12, 13,  30, 31, 32,  50, 51, 52, 53]
    positions = [0, 1, 2, 3,  0, 1, 2,  9, 10, 11, 12]
    starts = [0, 4, 7, 11]
    batch = SimpleNamespace(num_reqs=3, num_tokens=11, req_ids=["p-end", "p-mid", "verify"],
                            query_start_loc_np=np.array(starts), idx_mapping=torch.tensor([2, 0, 1]),
                            idx_mapping_np=np.array([2, 0, 1]), num_draft_tokens_per_req=np.array([0, 0, 3]),
                            input_ids=torch.tensor(ids + [0, 0]), positions=torch.tensor(positions + [0, 0]))
    hidden = torch.arange(13 * HIDDEN, dtype=torch.float32).view(13, HIDDEN)
    aux = [hidden + 1000, hidden + 2000]
    num_sampled, num_rejected = torch.tensor([1, 0, 2]), torch.tensor([0, 0, 2])
    last_sampled = torch.zeros(4, 1, dtype=torch.int64)
    last_sampled[2], last_sampled[1] = 14, 77   # slot 2: p-end's first sample; slot 1: verify's bonus
    prompt_lens = np.array([9, 9, 4, 0])
    return batch, hidden, aux, num_sampled, num_rejected, last_sampled, prompt_lens


def _v1_reference_view(hidden, aux):
    """The same step as the V1 runner's ``capture_step_view`` builds it: sampled lists per request."""
    ids = torch.tensor([10, 11, 12, 13, 30, 31, 32, 50, 51, 52, 53])
    requests = [{"request_id": "p-end", "start": 0, "end": 4, "num_spec": 0, "sampled": [14], "logit_row": 0,
                 "num_prompt_tokens": 4},
                {"request_id": "p-mid", "start": 4, "end": 7, "num_spec": 0, "sampled": [], "logit_row": 1,
                 "num_prompt_tokens": 9},
                {"request_id": "verify", "start": 7, "end": 11, "num_spec": 3, "sampled": [51, 77], "logit_row": 2,
                 "num_prompt_tokens": 9}]
    return {"input_ids": ids, "positions": torch.tensor([0, 1, 2, 3, 0, 1, 2, 9, 10, 11, 12]),
            "final_hidden": hidden[:11], "aux_hidden": [h[:11] for h in aux], "drafter": "eagle3",
            "logits": None, "requests": requests}


def test_mrv2_rows_are_the_v1_runners_rows_for_the_same_step():
    batch, hidden, aux, sampled, rejected, last, prompt_lens = _step()
    view = mrv2_step_view(batch, hidden, aux, sampled, rejected, last, prompt_lens)
    got = step_frames(view, dtype=torch.float32)
    want = step_frames(_v1_reference_view(hidden, aux), dtype=torch.float32)
    assert [h for h, _ in got] == [h for h, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in g)
    by_id = {h["request_id"]: (h, t) for h, t in got}
    header, tensors = by_id["verify"]
    # x_last and the accepted draft are committed; the rejected drafts' rows are not
    assert header["token_ids"] == [50, 51] and header["next_token_ids"] == [51, 77]
    assert torch.equal(tensors["final_hidden"], hidden[7:9])
    assert by_id["p-mid"][0]["next_token_ids"] == [31, 32, -1]
    assert by_id["p-end"][0]["next_token_ids"] == [11, 12, 13, 14]
    assert "logprobs" not in tensors  # a speculator is not handed the sampler's logits


def test_a_row_layout_the_view_was_not_written_for_is_refused():
    batch, hidden, aux, sampled, rejected, last, prompt_lens = _step()
    with pytest.raises(ValueError, match="do not fill"):
        mrv2_step_view(batch, hidden, aux, sampled, torch.tensor([0, 0, 1]), last, prompt_lens)


def test_the_tee_counts_a_failing_tap_and_the_step_goes_on():
    batch, hidden, aux, sampled, rejected, last, prompt_lens = _step()
    tee, seen = CaptureTee(), []
    tee.offer(batch, hidden, aux, sampled, rejected, last, prompt_lens)  # no tap: nothing read
    tee.tap = seen.append
    tee.offer(batch, hidden, aux, sampled, rejected, last, prompt_lens)
    assert len(seen) == 1 and [r["request_id"] for r in seen[0]["requests"]] == ["p-end", "p-mid", "verify"]

    def broken(view):
        raise RuntimeError("sender gone")
    tee.tap = broken
    tee.offer(batch, hidden, aux, sampled, rejected, last, prompt_lens)
    assert tee.errors == 1 and "sender gone" in tee.last_error
