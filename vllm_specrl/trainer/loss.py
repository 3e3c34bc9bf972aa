"""EAGLE-3 training loss and the metrics that predict acceptance.

Step k of the training-time-test unroll at base position t predicts the token
at t+2+k; the target's distribution for it is the one at row t+1+k (its final
hidden state through the target's LM head, or the top-K logprobs the capture
path sent from the engine's own logits). Only base positions vLLM drafts from
count: t >= prompt length - 1 (``first``), so prompt positions, which a chat
template repeats in every sample, never inflate the loss or the estimates.

Objective per step and position, weighted by ``decay**k``:
- soft cross-entropy against the target distribution restricted to the draft
  vocabulary (the draft can propose nothing else);
- ``tv_weight * TV(p, q)``: at T=1 vLLM accepts a draft step with probability
  exactly ``1 - TV(p, q) = sum_x min(p(x), q(x))`` (p over the full vocabulary);
- with ``accept_weighted``, step k's positions are weighted by the probability
  that vLLM reaches step k there, ``prod_{j<k} min(1, q_j(x)/p_j(x))`` for the
  emitted tokens x (see ``acceptance``): an exact importance weight that makes
  the later steps train on the contexts the draft meets when its own
  proposals were accepted (on-policy for the states that matter), without a
  second target forward.

Metrics: per-step token accuracy and ``expected_accept_step{k}`` (mean of
``sum min(p, q)`` over drafted positions) and, in evaluation,
``served_accept_pos{k}`` / ``served_acceptance_length``, the expected value
of vLLM's own counters (``acceptance.served_acceptance``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_specrl.trainer.acceptance import StepAcceptance, served_acceptance


@dataclass
class LossConfig:
    decay: float = 0.8
    tv_weight: float = 0.0
    accept_weighted: bool = False


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]
    acceptance: StepAcceptance | None = None


@dataclass
class TargetRows:
    """The target's next-token distribution at every row of a padded batch.

    Either ``final_hidden`` (with the LM head; ``lse`` caches the full-vocabulary
    logsumexp per row when the features carry it) or ``topk_logprobs``/``topk_ids``
    from capture, with ``token_logprobs`` the logprob of each row's successor token.
    """

    token_ids: torch.Tensor                   # [B, T]
    final_hidden: torch.Tensor | None = None  # [B, T, H]
    lse: torch.Tensor | None = None           # [B, T]
    topk_logprobs: torch.Tensor | None = None  # [B, T, K]
    topk_ids: torch.Tensor | None = None       # [B, T, K]
    token_logprobs: torch.Tensor | None = None  # [B, T]


def valid_mask(lengths: torch.Tensor, seq_len: int, step: int,
               first: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] base positions where step ``step`` has a target: t >= first and row t+1+step exists."""
    t = torch.arange(seq_len, device=lengths.device)
    mask = t[None, :] + step + 2 <= lengths[:, None]
    if first is not None:
        mask &= t[None, :] >= first[:, None]
    return mask


def target_on_draft(rows: TargetRows, b_idx: torch.Tensor, r_idx: torch.Tensor, head: torch.Tensor | None,
                    draft_ids: torch.Tensor, draft_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p over the draft vocabulary [N, Vd], p of the row's successor token [N]) at rows (b, r).

    Probabilities are normalised over the *full* vocabulary: what vLLM's verifier uses.
    """
    nxt = rows.token_ids[b_idx, (r_idx + 1).clamp(max=rows.token_ids.shape[1] - 1)]
    if rows.topk_logprobs is not None:
        lp, ids = rows.topk_logprobs[b_idx, r_idx].float(), rows.topk_ids[b_idx, r_idx].long()
        slot = torch.where(ids >= 0, draft_index[ids.clamp(min=0)], -1)
        p_draft = torch.zeros(len(b_idx), len(draft_ids) + 1, device=lp.device)
        p_draft.scatter_(1, torch.where(slot >= 0, slot, len(draft_ids)),
                         torch.nan_to_num(lp, nan=float("-inf")).exp())
        return p_draft[:, :-1], rows.token_logprobs[b_idx, r_idx].float().exp()
    h = rows.final_hidden[b_idx, r_idx].float()
    lse = (rows.lse[b_idx, r_idx].float()[:, None] if rows.lse is not None
           else (h @ head.T).logsumexp(-1, keepdim=True))
    p_draft = ((h @ head[draft_ids].T) - lse).exp()
    p_next = ((h * head[nxt]).sum(-1, keepdim=True) - lse).exp()[:, 0]
    return p_draft, p_next


def eagle3_loss(step_logits: list[torch.Tensor], rows: TargetRows, target_lm_head: torch.Tensor | None,
                draft_token_ids: torch.Tensor, lengths: torch.Tensor, first: torch.Tensor | None = None,
                config: LossConfig | None = None, with_metrics: bool = True,
                served: bool = False) -> LossOutput:
    """Loss over TTT steps (one function on purpose: the steps of the chain share the reach probabilities,
    the draft-vocabulary index and the served-counter pass, which a split would hand around as state).

    step_logits:     list over steps of [B, T, Vd] draft logits
    rows:            the target's distributions (``TargetRows``)
    target_lm_head:  [V, H] target LM head (frozen; unused with top-K rows)
    draft_token_ids: [Vd] target id of each draft-vocabulary entry
    lengths:         [B] valid tokens per sequence
    first:           [B] first drafted base position (prompt length - 1); None counts all
    served:          also compute the expected vLLM counters (a sequential pass; evaluation)
    """
    cfg = config or LossConfig()
    b, t = rows.token_ids.shape
    device = step_logits[0].device
    vocab = target_lm_head.shape[0] if target_lm_head is not None else int(rows.topk_ids.max()) + 1
    vocab = max(vocab, int(draft_token_ids.max()) + 1)
    draft_index = torch.full((vocab,), -1, dtype=torch.long, device=device)
    draft_index[draft_token_ids] = torch.arange(len(draft_token_ids), device=device)
    total = torch.zeros((), device=device)
    weight_sum = 0.0
    metrics: dict[str, float] = {}
    steps = StepAcceptance([], [])
    reach = torch.ones(b, t, device=device)  # P(vLLM reaches step k at base t | emitted tokens)
    # Step k at base t reads row t+1+k: every step reads the same rows, so their target
    # distributions are computed once (rows after the first drafted base, inside the sequence).
    rows_needed = valid_mask(lengths, t, 0, first).roll(1, dims=1)
    rows_needed[:, 0] = False
    for k in range(1, len(step_logits)):
        rows_needed |= valid_mask(lengths, t, k, first).roll(1 + k, dims=1) & (
            torch.arange(t, device=device)[None, :] >= 1 + k)
    rb, rr = rows_needed.nonzero(as_tuple=True)
    row_slot = torch.full((b, t), -1, dtype=torch.long, device=device)
    row_slot[rb, rr] = torch.arange(len(rb), device=device)
    row_p_draft, row_p_next = target_on_draft(rows, rb, rr, target_lm_head, draft_token_ids, draft_index)
    for k, logits in enumerate(step_logits):
        mask = valid_mask(lengths, t, k, first)
        if not mask.any():  # no sequence long enough: nothing drafted at this step
            if with_metrics or served:
                steps.valid.append(mask)
                steps.accept_weight.append(torch.zeros(b, t, device=device))
            continue
        b_idx, t_idx = mask.nonzero(as_tuple=True)
        slots = row_slot[b_idx, t_idx + 1 + k]
        p_draft, p_next = row_p_draft[slots], row_p_next[slots]
        logq = logits[mask].float().log_softmax(-1)
        q = logq.exp()
        p_restricted = p_draft / p_draft.sum(-1, keepdim=True).clamp(min=1e-12)
        per_pos = -(p_restricted * logq).sum(-1)
        accept = torch.minimum(p_draft, q).sum(-1)
        if cfg.tv_weight:
            per_pos = per_pos + cfg.tv_weight * (1.0 - accept)
        # The emitted token's acceptance weight; past the end of a rollout (vLLM still drafts there
        # and counts it, the engine trims the output) the token is unknown: its expectation is `accept`.
        emitted = t_idx + 2 + k < lengths[b_idx]
        nxt = rows.token_ids[b_idx, (t_idx + 2 + k).clamp(max=t - 1)]
        slot = draft_index[nxt]
        q_next = torch.where(slot >= 0, q.gather(1, slot.clamp(min=0)[:, None])[:, 0], torch.zeros_like(p_next))
        weight_next = torch.where(emitted, (q_next / p_next.clamp(min=1e-12)).clamp(max=1.0), accept).detach()
        position_weight = reach[b_idx, t_idx] if cfg.accept_weighted else 1.0
        step_loss = (position_weight * per_pos).mean()
        w = cfg.decay**k
        total = total + w * step_loss
        weight_sum += w
        full_weight = torch.zeros(b, t, device=device)
        full_weight[b_idx, t_idx] = weight_next
        reach = reach * full_weight
        if with_metrics or served:
            # A draft starts at t only if the token at t + 1 was not the rollout's last.
            steps.valid.append(mask & (torch.arange(t, device=device)[None, :] + 2 < lengths[:, None]))
            steps.accept_weight.append(full_weight)
        if with_metrics:
            with torch.no_grad():
                metrics[f"loss_step{k}"] = step_loss.item()
                metrics[f"token_acc_step{k}"] = (logq.argmax(-1) == p_restricted.argmax(-1)).float().mean().item()
                metrics[f"expected_accept_step{k}"] = accept.mean().item()
    loss = total / max(weight_sum, 1e-9)
    if with_metrics:
        metrics["loss"] = loss.item()
        metrics["expected_acceptance_length"] = expected_acceptance_length(
            [metrics.get(f"expected_accept_step{k}", 0.0) for k in range(len(step_logits))])
    if served and steps.valid:
        first_pos = first if first is not None else torch.zeros(b, dtype=torch.long, device=device)
        est = served_acceptance(steps, first_pos)
        for k, value in enumerate(est["per_position"]):
            metrics[f"served_accept_pos{k}"] = value
        metrics["served_acceptance_length"] = est["acceptance_length"]
        metrics["served_drafts"] = est["drafts"]
        metrics["served_accepted"] = est["accepted_per_pos"]
    return LossOutput(loss, metrics, steps if (with_metrics or served) else None)


def expected_acceptance_length(per_step: list[float]) -> float:
    """1 + sum_k prod_{j<=k} a_j: tokens per verify step if step acceptances were independent."""
    length, chain = 1.0, 1.0
    for a in per_step:
        chain *= a
        length += chain
    return length
