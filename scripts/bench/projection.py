"""Step-time model for RL with speculative rollouts: from stage times to end-to-end speedup.

One RL step = rollout generation R + the rest O (reference-policy logprobs,
training, weight sync), in seconds of a plain (non-speculative) step.

Speculative rollout speedup. With acceptance length ``tau`` (tokens emitted
per verify step, bonus token included) and ``c`` the cost of one speculative
step in plain decode steps (k draft forwards plus one verify of k+1 tokens):

    s = tau / c,     c = 1 + k * d + v

where ``d`` is a draft forward's cost relative to a target forward and ``v``
the verify pass's extra cost for its k extra tokens (about 0 where decode is
memory-bound, as on a GPU at small batch; large on a CPU).

Synchronous RL (rollouts, then training):

    T_plain = R + O,    T_spec = R / s + O + D,    speedup = T_plain / T_spec

with ``D`` the added per-step cost of keeping the draft current (draft
training that is not overlapped, draft weight sync).

Asynchronous RL with policy lag 1 (rollouts of step t+1 overlap training of
step t): a step takes the longer of the two streams,

    T_async(s) = max(R / s, O) + D_exposed

so speculation pays only while generation is the longer stream, and the
gains stack with async as in the paper until training becomes the bottleneck.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StageTimes:
    rollout_s: float
    other_s: float              # logprob recomputation + training + sync, plain step
    draft_overhead_s: float = 0.0  # per-step cost added by speculation (draft sync, exposed training)

    @classmethod
    def from_share(cls, rollout_share: float, draft_overhead_share: float = 0.0) -> StageTimes:
        if not 0.0 < rollout_share < 1.0:
            raise ValueError(f"rollout share must be in (0, 1); got {rollout_share}")
        return cls(rollout_share, 1.0 - rollout_share, draft_overhead_share)


def rollout_speedup(acceptance_length: float, step_cost: float) -> float:
    """s = tau / c."""
    if step_cost <= 0:
        raise ValueError("step cost must be positive")
    return acceptance_length / step_cost


def acceptance_length(acceptance: float, k: int) -> float:
    """tau = 1 + a + ... + a^k: tokens per verify step when each draft is accepted with chance ``a``
    until the first rejection, bonus token included (Leviathan et al.)."""
    return sum(acceptance ** j for j in range(k + 1))


def acceptance_needed(step_cost: float, k: int, speedup: float = 1.0) -> float | None:
    """The per-draft acceptance ``a`` at which ``tau(a, k) / step_cost == speedup``: what a draft must
    reach for speculation at this step cost to pay ``speedup``; None where even a = 1 cannot."""
    want = speedup * step_cost
    if want > k + 1:
        return None
    if want <= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if acceptance_length(mid, k) < want else (lo, mid)
    return (lo + hi) / 2


def step_cost(k: int, draft_cost: float, verify_extra: float = 0.0) -> float:
    """c = 1 + k * d + v, in plain decode steps."""
    return 1.0 + k * draft_cost + verify_extra


def sync_speedup(t: StageTimes, s: float) -> float:
    return (t.rollout_s + t.other_s) / (t.rollout_s / s + t.other_s + t.draft_overhead_s)


def async_step(t: StageTimes, s: float) -> float:
    return max(t.rollout_s / s, t.other_s) + t.draft_overhead_s


def project(t: StageTimes, s: float) -> dict:
    """Every speedup the model gives for stage times ``t`` and rollout speedup ``s``."""
    plain_sync = t.rollout_s + t.other_s
    plain_async = max(t.rollout_s, t.other_s)
    return {
        "inputs": asdict(t) | {"rollout_speedup": s,
                               "rollout_share": t.rollout_s / plain_sync},
        "sync_step_speedup": sync_speedup(t, s),
        "async_plain_vs_sync_plain": plain_sync / plain_async,
        "async_spec_vs_async_plain": plain_async / async_step(t, s),
        "async_spec_vs_sync_plain": plain_sync / async_step(t, s),
        "rollout_bound_limit": plain_sync / (t.other_s + t.draft_overhead_s),
    }
