import pytest
import torch

from vllm_specrl.trainer.loss import eagle3_loss, expected_acceptance_length, valid_mask


def test_valid_mask_needs_an_input_token_and_a_target():
    m = valid_mask(torch.tensor([5, 3]), 6, step=1)
    assert m[0].tolist() == [True, True, True, False, False, False]   # t + 3 <= 5
    assert m[1].tolist() == [True, False, False, False, False, False]


def test_draft_equal_to_target_has_acceptance_one():
    torch.manual_seed(0)
    b, t, h, v = 2, 8, 16, 30
    final = torch.randn(b, t, h)
    head = torch.randn(v, h)
    shifted = torch.zeros_like(final)
    shifted[:, :-1] = final[:, 1:]
    logits = [shifted @ head.T]
    out = eagle3_loss(logits, final, head, torch.arange(v), torch.tensor([8, 8]))
    assert out.metrics["expected_accept_step0"] == pytest.approx(1.0, abs=1e-5)
    assert out.metrics["token_acc_step0"] == pytest.approx(1.0)
    uniform = eagle3_loss([torch.zeros(b, t, v)], final, head, torch.arange(v), torch.tensor([8, 8]))
    assert uniform.loss > out.loss
    assert uniform.metrics["expected_accept_step0"] < 0.9


def test_expected_acceptance_length_chains_steps():
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    assert expected_acceptance_length([]) == 1.0
