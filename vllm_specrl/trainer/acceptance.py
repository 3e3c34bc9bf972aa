"""What vLLM will measure for a draft, computed from rollouts of the target.

vLLM drafts only from completion positions, and only at the positions where a
verify step ends: a request whose prompt has ``P`` tokens is first drafted at
base position ``P - 1`` (the prefill's last row, whose input token is the
first sampled one), and a draft at base ``s`` that gets ``n`` tokens accepted
moves the next draft to base ``s + n + 1``. Its counters
(``vllm:spec_decode_num_accepted_tokens_per_pos[j] / num_drafts``) are
averages over those draft starts, so an average over every position, or one
that counts prompt positions, does not predict them.

Given a rollout sampled from the target (the speculative engine's own output
is one: speculation is lossless), the probability that draft step ``j`` at
base ``s`` is accepted, *conditioned on the token that was emitted there*, is
``w_j(s) = min(1, q_j(x) / p_j(x))`` (the emitted token is either the accepted
draft, with probability ``min(p, q)(x)``, or a recovered one). The draft's
step ``j`` sees exactly the teacher-forced context when steps ``< j`` were
accepted, so these weights are what the training-time-test unroll computes.
A dynamic program over draft starts then gives, per rollout, the exact
expected value of vLLM's per-position counters: ``served_acceptance`` is an
unbiased estimate of what the engine reports, not a proxy for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepAcceptance:
    """Per base position of a batch, for each TTT step (lists over steps of [B, T])."""

    valid: list[torch.Tensor]          # bool: step j at base t is a position vLLM drafts from
    accept_weight: list[torch.Tensor]  # min(1, q_j(x) / p_j(x)) for the emitted token x


def draft_starts(valid: list[torch.Tensor], accept_weight: list[torch.Tensor],
                 first: torch.Tensor) -> torch.Tensor:
    """[B, T] probability that vLLM starts a draft at each base position.

    ``first`` [B] is the first base position drafted (prompt length - 1). A
    position with no valid step ends the walk (the request is finished there).
    """
    b, t = valid[0].shape
    k = len(valid)
    device = valid[0].device
    start = torch.zeros(b, t + k + 2, device=device)
    start[torch.arange(b, device=device), first.clamp(min=0)] = 1.0
    rows = torch.arange(b, device=device)
    for s in range(t):
        mass = start[:, s] * valid[0][:, s]
        start[:, s] = mass
        if not bool(mass.any()):
            continue
        chain = torch.ones(b, device=device)
        for n in range(k + 1):
            # n accepted: steps < n accepted and step n (if it was drafted) rejected.
            drafted = valid[n][:, s] if n < k else torch.zeros(b, dtype=torch.bool, device=device)
            stop = (1 - accept_weight[n][:, s]) if n < k else torch.ones(b, device=device)
            p_n = torch.where(drafted, chain * stop, chain)
            start[rows, s + n + 1] += mass * p_n
            if n < k:
                chain = torch.where(drafted, chain * accept_weight[n][:, s], torch.zeros_like(chain))
    return start[:, :t]


def served_acceptance(steps: StepAcceptance, first: torch.Tensor) -> dict[str, object]:
    """Expected ``accepted_per_pos[j] / num_drafts`` and acceptance length, as vLLM counts them.

    Returns sums too (``drafts``, ``accepted_per_pos``), so several batches can be pooled exactly.
    """
    start = draft_starts(steps.valid, steps.accept_weight, first)
    drafts = float(start.sum())
    accepted = []
    chain = torch.ones_like(start)
    for valid, weight in zip(steps.valid, steps.accept_weight):
        chain = chain * torch.where(valid, weight, torch.zeros_like(weight))
        accepted.append(float((start * chain).sum()))
    return summarize(drafts, accepted)


def summarize(drafts: float, accepted_per_pos: list[float]) -> dict[str, object]:
    """vLLM's derived figures from draft and per-position accepted counts (or their expectations)."""
    per_pos = [a / drafts if drafts else 0.0 for a in accepted_per_pos]
    return {"drafts": drafts, "accepted_per_pos": accepted_per_pos, "per_position": per_pos,
            "acceptance_length": 1.0 + sum(per_pos)}


def pool(results: list[dict[str, object]]) -> dict[str, object]:
    """Combine ``served_acceptance`` results of several batches (weighted by drafts)."""
    drafts = sum(float(r["drafts"]) for r in results)
    k = max(len(r["accepted_per_pos"]) for r in results)
    accepted = [sum(float(r["accepted_per_pos"][j]) for r in results if j < len(r["accepted_per_pos"]))
                for j in range(k)]
    return summarize(drafts, accepted)
