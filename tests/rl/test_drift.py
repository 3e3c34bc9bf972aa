"""The policy's drift from its start: exact KL on fixed sequences, against a hand computation."""

import pytest
import torch

from vllm_specrl.rl.drift import PolicyDrift, token_kl


class TinyLM(torch.nn.Module):
    """logits = embedding(ids) @ head: enough of a causal LM for PolicyDrift (``.logits``)."""

    def __init__(self, vocab: int = 11, width: int = 6):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.head(self.embed(input_ids))})()


def test_token_kl_matches_the_definition_and_is_zero_on_itself():
    p, q = torch.randn(3, 7), torch.randn(3, 7)
    want = (p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum(-1)
    assert torch.allclose(token_kl(p, q), want, atol=1e-6)
    assert torch.allclose(token_kl(p, p), torch.zeros(3), atol=1e-6)


def test_drift_is_zero_at_the_start_and_counts_only_completion_positions():
    torch.manual_seed(0)
    model = TinyLM()
    seqs = [([1, 2, 3], [4, 5]), ([6], [7, 8, 9])]
    drift = PolicyDrift(model, seqs)
    assert drift.kl(model) == pytest.approx(0.0, abs=1e-7)
    with torch.no_grad():
        model.head.weight.add_(torch.randn_like(model.head.weight))
    # by hand: the positions that predict each completion token, in both models
    total, count = 0.0, 0
    for prompt, completion in seqs:
        ids = torch.tensor([prompt + completion])
        span = slice(len(prompt) - 1, len(prompt) + len(completion) - 1)
        total += float(token_kl(model(ids).logits[0, span], drift.reference(ids).logits[0, span]).sum())
        count += len(completion)
    assert drift.kl(model) == pytest.approx(total / count, rel=1e-5) and total > 0
    assert model.training  # restored


def test_drift_needs_completions():
    with pytest.raises(ValueError, match="completion"):
        PolicyDrift(TinyLM(), [([1, 2], [])])
