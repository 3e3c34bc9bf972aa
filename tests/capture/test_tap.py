"""``step_frames``: committed rows only, with the sampled tokens' logprobs from the step's own logits,
scored in the step or (``defer_scoring``) from rows copied in the step and scored in the sender thread."""

import math

import torch

from vllm_specrl.capture.receiver import SequenceAssembler
from vllm_specrl.capture.tap import CaptureTap, collect_step, exact_topk, step_frames

H, V = 4, 32


def view(logits: torch.Tensor | None) -> dict:
    # Request "a" verifies 3 drafts at positions 5..8 (rows 0..3), 1 accepted + bonus => 2 sampled.
    # Request "b" ends its prefill: rows 4..6 are prompt positions 0..2, one sampled token.
    ids = torch.tensor([11, 12, 13, 14, 21, 22, 23])
    return {"input_ids": ids, "positions": torch.tensor([5, 6, 7, 8, 0, 1, 2]),
            "final_hidden": torch.arange(7 * H, dtype=torch.float32).view(7, H),
            "aux_hidden": [torch.ones(7, H) * k for k in range(3)], "logits": logits,
            "requests": [{"request_id": "a", "start": 0, "end": 4, "num_spec": 3, "sampled": [12, 7],
                          "logit_row": 0},
                         {"request_id": "b", "start": 4, "end": 7, "num_spec": 0, "sampled": [9],
                          "logit_row": 4}]}


def test_committed_rows_and_their_sampled_logprobs():
    logits = torch.randn(5, V)  # a: 4 rows (3 drafts + 1), b: 1 row
    logp = logits.log_softmax(-1)
    frames = dict((h["request_id"], (h, t)) for h, t in step_frames(view(logits), topk=2))
    ha, ta = frames["a"]
    assert ha["positions"] == [5, 6] and ha["token_ids"] == [11, 12] and ha["next_token_ids"] == [12, 7]
    torch.testing.assert_close(ta["logprobs"], torch.stack([logp[0, 12], logp[1, 7]]))
    assert ta["topk_ids"].tolist() == logp[:2].topk(2).indices.tolist()
    hb, tb = frames["b"]
    assert hb["next_token_ids"] == [22, 23, 9]
    assert math.isnan(tb["logprobs"][0]) and math.isnan(tb["logprobs"][1])  # followed by prompt tokens
    torch.testing.assert_close(tb["logprobs"][2], logp[4, 9])
    assert tb["topk_ids"][0].tolist() == [-1, -1]


def test_no_logits_no_logprobs():
    for _, tensors in step_frames(view(None)):
        assert set(tensors) == {"aux_hidden", "final_hidden"}


def test_recomputed_rows_keep_the_sampled_logprob():
    """After preemption a request's generated tokens come back as prefill rows, without logprobs."""
    logits = torch.randn(5, V)
    asm = SequenceAssembler()
    for header, tensors in step_frames(view(logits)):
        asm.add(header, tensors)
    before = asm.requests["b"].rows[2][4]
    header = {"request_id": "b", "positions": [2], "token_ids": [23], "next_token_ids": [9]}
    asm.add(header, {"aux_hidden": torch.zeros(1, 3 * H), "final_hidden": torch.zeros(1, H),
                     "logprobs": torch.tensor([float("nan")])})
    assert asm.requests["b"].rows[2][4] == before
    header = dict(header, next_token_ids=[-1])  # the row ends a recomputed prefill chunk
    asm.add(header, {"aux_hidden": torch.zeros(1, 3 * H), "final_hidden": torch.zeros(1, H)})
    assert asm.requests["b"].rows[2][4] == before
    seq = asm.pop("b")
    assert seq["logprobs"].shape == (3,) and seq["logprobs"][2] == before


def test_calibration_requests_are_never_captured(monkeypatch):
    """The synthetic requests of an adaptive-k calibration sweep would teach the draft their text."""
    from vllm_specrl.adaptive import calibration_ids

    monkeypatch.setenv(calibration_ids.TOKEN_ENV, "5e6f")
    monkeypatch.setattr(calibration_ids, "_marker", None)
    v = view(torch.randn(5, V))
    v["requests"][0]["request_id"] = f"2_cmpl-{calibration_ids.request_id('5e6f', 4, '0a1b2c3d')}-0-5e6f7a8b"
    assert [h["request_id"] for h, _ in step_frames(v)] == ["b"]


def test_exact_topk_equals_torch_topk():
    """The block pre-selection must return torch's top-k exactly: values largest first, the ids
    of those values, on rows where the winners crowd into one block, spread out, or tie."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16384, generator=g)
    x[1, 128:256] += 8.0           # all of the top-64 in two neighbouring blocks
    x[2, ::256] += 8.0             # one winner per block, in 64 different blocks
    x[3] = torch.randn(16384, generator=g).round()  # massive ties (few distinct values)
    x[4, :] = float("-inf")        # a masked vocabulary: only 100 finite entries
    x[4, 5000:5100] = torch.randn(100, generator=g)
    want = x.topk(64, dim=-1)
    values, ids = exact_topk(x, 64)
    assert torch.equal(values, want.values)
    assert torch.equal(x.gather(-1, ids), values)
    assert all(len(set(row.tolist())) == 64 for row in ids)
    tie_free = [0, 1, 2, 4, 5]
    assert torch.equal(ids[tie_free], want.indices[tie_free])
    narrow = torch.randn(3, 4000, generator=g)  # not a whole number of blocks: torch.topk itself
    assert torch.equal(exact_topk(narrow, 64)[1], narrow.topk(64, dim=-1).indices)


def test_batched_scoring_matches_per_request_scoring_at_a_real_vocabulary_width():
    """Top-k and logprobs over a vocabulary wide enough for the block path, rows not contiguous
    (request a's rejected drafts sit between the scored rows)."""
    logits = torch.randn(5, 8192, generator=torch.Generator().manual_seed(1)) * 3
    logp = logits.log_softmax(-1)
    frames = dict((h["request_id"], t) for h, t in step_frames(view(logits), topk=64))
    ta, tb = frames["a"], frames["b"]
    torch.testing.assert_close(ta["topk_logprobs"], logp[:2].topk(64).values)
    assert ta["topk_ids"].tolist() == logp[:2].topk(64).indices.tolist()
    torch.testing.assert_close(tb["topk_logprobs"][2], logp[4].topk(64).values)
    assert tb["topk_ids"][2].tolist() == logp[4].topk(64).indices.tolist()
    torch.testing.assert_close(tb["logprobs"][2], logp[4, 9])
    assert ta["final_hidden"].tolist() == view(None)["final_hidden"][:2].to(torch.bfloat16).tolist()
    assert tb["aux_hidden"][:, H:2 * H].tolist() == [[1.0] * H] * 3


def _same_frames(got, want) -> None:
    assert [h for h, _ in got] == [h for h, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], equal_nan=True, rtol=0, atol=0)


def test_deferred_scoring_copies_the_rows_now_and_scores_them_as_the_step_would():
    """With ``defer_scoring`` the step only copies the logit rows it needs; the runner may overwrite its
    buffers before ``frames()`` runs (in the sender thread), and the frames are those of scoring in-step,
    from logits and from the sampler's log-softmax alike."""
    logits = torch.randn(5, 8192, generator=torch.Generator().manual_seed(2)) * 3
    for raw in (None, logits.log_softmax(-1)):
        v = view(logits.clone())
        v["raw_logprobs"] = None if raw is None else raw.clone()
        want = step_frames(v, topk=64)
        capture = collect_step(v, topk=64, defer_scoring=True)
        assert capture.scored is None and capture.to_score[0].shape == (3, 8192)  # a's 2 rows, b's last
        v["logits"].fill_(0.0)  # the runner's next step
        if raw is not None:
            v["raw_logprobs"].fill_(0.0)
        v["final_hidden"].fill_(-1.0)
        _same_frames(capture.frames(), want)


def test_the_tap_leaves_scoring_to_a_sender_on_cpus_of_its_own():
    """A sender off the worker's cores gets the step's rows unscored; one beside them (``inherit``) gets
    them scored in the step. The frames are the same either way, with the step's version and number."""
    logits = torch.randn(5, V)

    class Sender:
        def __init__(self, cpus):
            self.cpus, self.offered = cpus, []

        def offer_step(self, pending):
            self.offered.append(pending)
            return True

    want = step_frames(view(logits), topk=2)
    wide_enough = list(range(torch.get_num_threads()))  # as many CPUs as a new thread's torch threads
    for cpus, deferred in ((wide_enough, True), ([], False)):
        sender = Sender(cpus)
        tap = CaptureTap(sender, 1.0, lambda: 7, dtype=torch.bfloat16, topk=2)
        tap(view(logits))
        (pending,) = sender.offered
        assert (pending.scored is None) == deferred and tap.steps_scored_by_sender == int(deferred)
        frames = pending.frames()
        assert all(h["policy_version"] == 7 and h["step"] == 1 for h, _ in frames)
        _same_frames([({k: x for k, x in h.items() if k not in ("policy_version", "step")}, t) for h, t in frames],
                     want)
