"""How far RL has moved the policy: KL(current || start) on fixed held-out sequences.

A draft goes stale when the policy it drafts for moves, so a staleness run reports the move beside
the acceptance. ``PolicyDrift`` keeps a frozen copy of the starting policy and fixed sequences (held-out
prompts with the starting policy's own answers), and measures the full-vocabulary KL of the current
policy from the start at every completion position of them: exact (no sampling noise), cheap (one
forward of each model over a few sequences), and comparable from step to step because the sequences
never change.
"""

from __future__ import annotations

import copy

import torch


def token_kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position over the vocabulary, from logits of shape (..., vocab)."""
    logp, logq = torch.log_softmax(logits_p.float(), -1), torch.log_softmax(logits_q.float(), -1)
    return (logp.exp() * (logp - logq)).sum(-1)


class PolicyDrift:
    """KL of a policy from a frozen copy of it, on fixed sequences.

    ``sequences``: (prompt_ids, completion_ids) pairs; only completion positions count (what the policy
    writes, not the prompt it reads)."""

    def __init__(self, model: torch.nn.Module, sequences: list[tuple[list[int], list[int]]]):
        if not sequences or not all(c for _, c in sequences):
            raise ValueError("PolicyDrift needs sequences with at least one completion token each")
        self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.sequences = sequences

    @torch.no_grad()
    def kl(self, model: torch.nn.Module) -> float:
        """Mean KL(model || reference) per completion token over the sequences."""
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        try:
            for prompt, completion in self.sequences:
                ids = torch.tensor([prompt + completion])
                # the logits that predict each completion token
                span = slice(len(prompt) - 1, len(prompt) + len(completion) - 1)
                kl = token_kl(model(input_ids=ids).logits[0, span], self.reference(input_ids=ids).logits[0, span])
                total, count = total + float(kl.sum()), count + kl.numel()
        finally:
            model.train(was_training)
        return total / count
