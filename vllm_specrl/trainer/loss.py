"""EAGLE-3 training loss and the metrics that predict acceptance.

Soft cross-entropy against the target's own next-token distribution (not the
sampled token): step k of the training-time-test unroll at base position t
predicts the token at t+2+k, whose target distribution comes from the target's
final hidden state at position t+1+k through the target's LM head. Later
steps are weighted by ``decay**k``. With a reduced draft vocabulary the target
distribution is restricted to it and renormalised (the draft can propose
nothing else); metrics use the full distribution.

Expected acceptance of step k is ``sum_x min(p(x), q(x))``, the probability
that vLLM's rejection sampler accepts a token drawn from the draft q when the
target is p; chaining the per-step figures gives an expected acceptance length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def valid_mask(lengths: torch.Tensor, seq_len: int, step: int) -> torch.Tensor:
    """[B, T] mask of base positions t where step ``step`` has an input token and a target."""
    t = torch.arange(seq_len, device=lengths.device)
    return t[None, :] + step + 2 <= lengths[:, None]


def eagle3_loss(step_logits: list[torch.Tensor], target_final_hidden: torch.Tensor,
                target_lm_head: torch.Tensor, draft_token_ids: torch.Tensor, lengths: torch.Tensor,
                decay: float = 0.8, with_metrics: bool = True) -> LossOutput:
    """Loss over TTT steps.

    step_logits:         list over steps of [B, T, Vd] draft logits
    target_final_hidden: [B, T, H] target's post-norm final hidden states
    target_lm_head:      [V, H] target LM head (frozen)
    draft_token_ids:     [Vd] target id of each draft-vocabulary entry
    lengths:             [B] valid tokens per sequence
    """
    b, t, _ = target_final_hidden.shape
    head_draft = target_lm_head[draft_token_ids]
    total = torch.zeros((), device=target_final_hidden.device)
    weight_sum = 0.0
    metrics: dict[str, float] = {}
    for k, logits in enumerate(step_logits):
        mask = valid_mask(lengths, t, k)
        if not mask.any():
            break
        # Target distribution for the token at t+2+k comes from position t+1+k.
        hidden = torch.zeros_like(target_final_hidden)
        hidden[:, : t - 1 - k] = target_final_hidden[:, 1 + k :]
        h = hidden[mask]
        target_logits_draft = (h @ head_draft.T).float()
        p_restricted = target_logits_draft.softmax(-1)
        logq = logits[mask].float().log_softmax(-1)
        step_loss = -(p_restricted * logq).sum(-1).mean()
        w = decay**k
        total = total + w * step_loss
        weight_sum += w
        if with_metrics:
            with torch.no_grad():
                full_lse = (h @ target_lm_head.T).float().logsumexp(-1, keepdim=True)
                p_full_on_draft = (target_logits_draft - full_lse).exp()
                q = logq.exp()
                metrics[f"loss_step{k}"] = step_loss.item()
                metrics[f"token_acc_step{k}"] = (
                    (logq.argmax(-1) == target_logits_draft.argmax(-1)).float().mean().item())
                metrics[f"expected_accept_step{k}"] = torch.minimum(p_full_on_draft, q).sum(-1).mean().item()
    loss = total / max(weight_sum, 1e-9)
    if with_metrics:
        metrics["loss"] = loss.item()
        metrics["expected_acceptance_length"] = expected_acceptance_length(
            [metrics[k] for k in sorted(metrics) if k.startswith("expected_accept_step")])
    return LossOutput(loss, metrics)


def expected_acceptance_length(per_step: list[float]) -> float:
    """1 + sum_k prod_{j<=k} a_j: tokens per verify step if step acceptances were independent."""
    length, chain = 1.0, 1.0
    for a in per_step:
        chain *= a
        length += chain
    return length

