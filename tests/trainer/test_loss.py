import pytest
import torch

from vllm_specrl.trainer.loss import (
    LossConfig,
    TargetRows,
    eagle3_loss,
    expected_acceptance_length,
    valid_mask,
)

B, T, H, V = 2, 8, 16, 30


def test_valid_mask_needs_an_input_token_a_target_and_a_completion_position():
    m = valid_mask(torch.tensor([5, 3]), 6, step=1)
    assert m[0].tolist() == [True, True, True, False, False, False]   # t + 3 <= 5
    assert m[1].tolist() == [True, False, False, False, False, False]
    m = valid_mask(torch.tensor([6, 6]), 6, step=0, first=torch.tensor([2, 0]))
    assert m[0].tolist() == [False, False, True, True, True, False]    # t >= prompt length - 1


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    final = torch.randn(B, T, H, generator=g)
    head = torch.randn(V, H, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    shifted = torch.zeros_like(final)
    shifted[:, :-1] = final[:, 1:]
    return final, head, tokens, shifted @ head.T


def test_draft_equal_to_target_has_acceptance_one():
    final, head, tokens, exact = _case()
    rows = TargetRows(tokens, final)
    lengths = torch.tensor([T, T])
    out = eagle3_loss([exact], rows, head, torch.arange(V), lengths, served=True)
    assert out.metrics["expected_accept_step0"] == pytest.approx(1.0, abs=1e-5)
    assert out.metrics["served_accept_pos0"] == pytest.approx(1.0, abs=1e-5)
    assert out.metrics["token_acc_step0"] == pytest.approx(1.0)
    uniform = eagle3_loss([torch.zeros(B, T, V)], rows, head, torch.arange(V), lengths)
    assert uniform.loss > out.loss
    assert uniform.metrics["expected_accept_step0"] < 0.9


def test_prompt_positions_do_not_count():
    """A draft that is exact on prompt positions and uniform on completions scores as uniform."""
    final, head, tokens, exact = _case()
    first = torch.tensor([4, 4])
    mixed = exact.clone()
    mixed[:, 4:] = 0.0
    lengths = torch.tensor([T, T])
    rows = TargetRows(tokens, final)
    completion_only = eagle3_loss([mixed], rows, head, torch.arange(V), lengths, first)
    uniform = eagle3_loss([torch.zeros(B, T, V)], rows, head, torch.arange(V), lengths, first)
    assert completion_only.metrics["expected_accept_step0"] == pytest.approx(
        uniform.metrics["expected_accept_step0"], abs=1e-6)
    everything = eagle3_loss([mixed], rows, head, torch.arange(V), lengths)
    assert everything.metrics["expected_accept_step0"] > completion_only.metrics["expected_accept_step0"] + 0.2


def test_topk_rows_give_the_same_loss_as_hidden_rows_when_k_covers_the_vocabulary():
    final, head, tokens, _ = _case()
    logits = torch.randn(B, T, 10, generator=torch.Generator().manual_seed(1))
    draft_ids = torch.arange(0, 30, 3)   # a reduced draft vocabulary
    lengths, first = torch.tensor([T, 6]), torch.tensor([1, 2])
    cfg = LossConfig(tv_weight=0.5, accept_weighted=True)
    ref = eagle3_loss([logits, logits.roll(1, -1)], TargetRows(tokens, final), head, draft_ids, lengths, first,
                      cfg, served=True)
    logp = (final @ head.T).log_softmax(-1)
    top_v, top_i = logp.topk(V, dim=-1)
    nxt = torch.zeros(B, T, dtype=torch.long)
    nxt[:, :-1] = tokens[:, 1:]
    rows = TargetRows(tokens, topk_logprobs=top_v, topk_ids=top_i, token_logprobs=logp.gather(-1,
                                                                                              nxt[..., None])[..., 0])
    got = eagle3_loss([logits, logits.roll(1, -1)], rows, None, draft_ids, lengths, first, cfg, served=True)
    assert got.loss.item() == pytest.approx(ref.loss.item(), rel=1e-5)
    for key in ("expected_accept_step0", "expected_accept_step1", "served_accept_pos0", "served_accept_pos1"):
        assert got.metrics[key] == pytest.approx(ref.metrics[key], rel=1e-5), key
    # Truncating to the top 3 loses mass: acceptance can only be under-estimated.
    rows3 = TargetRows(tokens, topk_logprobs=top_v[..., :3], topk_ids=top_i[..., :3],
                       token_logprobs=rows.token_logprobs)
    trunc = eagle3_loss([logits], rows3, None, draft_ids, lengths, first, cfg)
    assert trunc.metrics["expected_accept_step0"] < ref.metrics["expected_accept_step0"]


def test_tv_term_and_acceptance_weighting_change_the_objective():
    final, head, tokens, exact = _case()
    noisy = exact + torch.randn_like(exact)
    rows = TargetRows(tokens, final)
    lengths = torch.tensor([T, T])
    base = eagle3_loss([noisy, noisy], rows, head, torch.arange(V), lengths)
    tv = eagle3_loss([noisy, noisy], rows, head, torch.arange(V), lengths, config=LossConfig(tv_weight=1.0))
    accept = 1 - (0.8**0 * base.metrics["expected_accept_step0"] + 0.8 * base.metrics["expected_accept_step1"]) / 1.8
    assert tv.loss.item() == pytest.approx(base.loss.item() + accept, rel=1e-5)
    weighted = eagle3_loss([noisy, noisy], rows, head, torch.arange(V), lengths,
                           config=LossConfig(accept_weighted=True))
    # Step 1 positions are weighted by the probability that step 0 was accepted (< 1).
    assert weighted.metrics["loss_step1"] < base.metrics["loss_step1"]
    assert weighted.metrics["loss_step0"] == pytest.approx(base.metrics["loss_step0"])


def test_expected_acceptance_length_chains_steps():
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    assert expected_acceptance_length([]) == 1.0
