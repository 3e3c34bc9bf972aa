"""Choose k (drafts per step) that maximises expected tokens per second, from what the engine sees.

Two estimates, both kept current from the engine's own steps:

* **acceptance**: per draft position j, how often position j is accepted given that
  positions < j were (exponentially decayed counts per position, so a policy update
  that moves the draft's quality is followed within a few hundred drafts). Expected
  tokens per request and step with k drafts: ``1 + sum_{j<k} prod_{i<=j} c_i``.
* **cost**: the measured wall time of a decode step, per batch-size bucket (1, 2-3,
  4-7, 8-15, ...) and k: the median of its recent steady steps (every request
  verifying k drafts and drafting k more). Measured, not modelled: on a CPU a verify
  pass is memory-bound at one token per sequence and compute-bound at a few, so
  step time is far from linear in batch x tokens, and a fitted line extrapolated
  from one batch size to another picked the wrong k by 40% in a test on SmolLM2.

Per bucket, the k with the largest ``E[tokens | k] / t(bucket, k)`` is served (k = 0:
no speculation, where it cannot pay). Every (bucket, k) is measured before the bucket
is trusted, in bursts of a few steps (the first step of a burst verifies the previous
k: not steady, not counted); afterwards bursts at a neighbour of the best k, at gaps
that double from ``explore_first`` to ``explore_every`` steps of that bucket, correct
an unlucky first measurement quickly and keep both estimates current. Nothing here
changes what is sampled: only how many drafts are verified.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np


def batch_bucket(batch: int) -> int:
    """0 for 1 sequence, 1 for 2-3, 2 for 4-7, ... (floor of log2)."""
    return max(batch, 1).bit_length() - 1


@dataclass
class AdaptiveKConfig:
    """Knobs (``--additional-config '{"specrl": {"adaptive_k": {...}}}'``)."""

    burst: int = 5                 # steps run at a k being measured (the first is not counted)
    min_samples: int = 8           # steady steps per (bucket, k) before the bucket is trusted
    explore_first: int = 16        # steps of a bucket before its first burst at a neighbour of its best
    explore_every: int = 256       # ... the gap doubles after each burst, up to this
    cost_window: int = 32          # steady steps per (bucket, k) the step time is the median of
    decay: float = 0.998           # per-sample decay of each position's acceptance counts
    prior_accept: float = 0.5      # prior conditional acceptance of a position with no data
    prior_weight: float = 2.0      # its weight, in drafts
    optimism: float = 1.0          # standard errors added to each position's acceptance when choosing

    @classmethod
    def from_dict(cls, raw: dict | bool | None) -> "AdaptiveKConfig":
        if not isinstance(raw, dict):
            return cls()
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown adaptive_k keys {sorted(unknown)}; "
                             f"known: {sorted(cls.__dataclass_fields__)}")
        return cls(**raw)


@dataclass
class AcceptanceTracker:
    """Decayed per-position counts: drafts that reached position j, and were accepted there."""

    max_k: int
    decay: float = 0.998
    prior_accept: float = 0.5
    prior_weight: float = 2.0
    reached: np.ndarray = field(init=False)
    accepted: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.reached = np.zeros(self.max_k)
        self.accepted = np.zeros(self.max_k)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verify: ``num_drafts`` proposed, the first ``num_accepted`` accepted."""
        if num_drafts <= 0:
            return
        reached = min(num_drafts, num_accepted + 1, self.max_k)
        # Decay only the positions this verify reached: each position's estimate covers its own
        # last ~1/(1 - decay) samples, however rarely drafts are that long.
        self.reached[:reached] *= self.decay
        self.accepted[:reached] *= self.decay
        self.reached[:reached] += 1.0
        self.accepted[:min(num_accepted, self.max_k)] += 1.0

    def conditional(self) -> np.ndarray:
        """Acceptance of position j given positions < j were accepted (with the prior)."""
        return (self.accepted + self.prior_accept * self.prior_weight) / (self.reached + self.prior_weight)

    def expected_tokens(self, optimism: float = 0.0) -> np.ndarray:
        """``E[tokens per request and step | k]`` for k = 0..max_k; with ``optimism`` z, each
        position's acceptance is raised by z standard errors (few samples: a larger bonus), so
        a position that was unlucky in its first few drafts gets drafted again and measured."""
        c = self.conditional()
        if optimism:
            c = np.minimum(1.0, c + optimism * np.sqrt(c * (1 - c) / (self.reached + self.prior_weight)))
        return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(c))])


class StepCostTable:
    """Step time per (batch bucket, k): the median of its last ``window`` steady steps (one slow
    step, a GC pause or another process's burst, moves a median little and a mean a lot)."""

    def __init__(self, max_k: int, num_buckets: int, window: int = 16):
        self.recent = [[deque(maxlen=window) for _ in range(max_k + 1)] for _ in range(num_buckets)]
        self.seconds = np.full((num_buckets, max_k + 1), np.nan)
        self.samples = np.zeros((num_buckets, max_k + 1), dtype=int)

    def observe(self, bucket: int, k: int, seconds: float) -> None:
        self.recent[bucket][k].append(seconds)
        self.seconds[bucket, k] = float(np.median(self.recent[bucket][k]))
        self.samples[bucket, k] += 1


@dataclass
class _Bucket:
    best: int
    calibrated: bool = False
    burst_k: int | None = None
    burst_left: int = 0
    steps_since_burst: int = 0
    explore_gap: int = 16


class AdaptiveKController:
    """The policy: ``lookup_for_step()`` before a schedule, ``record_choice`` and ``observe_step`` after."""

    def __init__(self, max_k: int, max_batch: int, config: AdaptiveKConfig | None = None,
                 clock=time.perf_counter):
        self.cfg = config or AdaptiveKConfig()
        self.max_k, self.max_batch = max_k, max_batch
        self.acceptance = AcceptanceTracker(max_k, self.cfg.decay, self.cfg.prior_accept,
                                            self.cfg.prior_weight)
        self.num_buckets = batch_bucket(max_batch) + 1
        self.cost = StepCostTable(max_k, self.num_buckets, self.cfg.cost_window)
        self.buckets = [_Bucket(best=max_k, explore_gap=self.cfg.explore_first) for _ in range(self.num_buckets)]
        self.clock = clock
        self.steps = 0
        self.steady_steps = 0
        self.explored_steps = 0
        self.chosen_counts = [0] * (max_k + 1)
        self.last_choice = max_k

    # --- choice ---------------------------------------------------------------------

    def _next_burst(self, bucket: int) -> int | None:
        """The k a bucket should measure next, or None to serve its best."""
        state = self.buckets[bucket]
        samples = self.cost.samples[bucket]
        if not state.calibrated:
            missing = [k for k in range(self.max_k + 1) if samples[k] < self.cfg.min_samples]
            if missing:
                return min(missing, key=lambda k: (samples[k], -k))
            state.calibrated = True
            self._choose(bucket)
        if state.steps_since_burst >= state.explore_gap:
            state.steps_since_burst = 0
            state.explore_gap = min(2 * state.explore_gap, self.cfg.explore_every)
            neighbours = [k for k in (state.best - 1, state.best + 1) if 0 <= k <= self.max_k]
            return min(neighbours, key=lambda k: samples[k])
        return None

    def k_for_bucket(self, bucket: int) -> int:
        state = self.buckets[bucket]
        if state.burst_left <= 0:
            state.burst_k = self._next_burst(bucket)
            state.burst_left = self.cfg.burst if state.burst_k is not None else 0
        return state.burst_k if state.burst_left > 0 else state.best

    def lookup_for_step(self) -> list[int]:
        """The batch-size -> k table for the next schedule (index 0 unused)."""
        by_bucket = [self.k_for_bucket(b) for b in range(self.num_buckets)]
        return [by_bucket[0]] + [by_bucket[batch_bucket(b)] for b in range(1, self.max_batch + 1)]

    def record_choice(self, batch: int, k: int) -> None:
        """The step vLLM scheduled: ``batch`` requests, ``k`` drafts to propose for the next."""
        self.steps += 1
        state = self.buckets[batch_bucket(min(batch, self.max_batch))]
        if state.burst_left > 0:
            state.burst_left -= 1
            self.explored_steps += state.calibrated
        else:
            state.steps_since_burst += 1
        if 0 <= k <= self.max_k:
            self.chosen_counts[k] += 1
        self.last_choice = k

    def k_for(self, batch: int) -> int:
        """The k served at this batch size outside measurement bursts."""
        return self.buckets[batch_bucket(min(batch, self.max_batch))].best

    # --- observation -----------------------------------------------------------------

    def observe_step(self, batch: int, k_verify: int, k_draft: int, seconds: float | None,
                     verified: list[tuple[int, int]]) -> None:
        """A step's output: its shape, its wall time (None when it was not a clean decode
        step), and ``(drafts, accepted)`` per request that verified drafts."""
        for drafts, accepted in verified:
            self.acceptance.observe(drafts, accepted)
        if seconds is None or seconds <= 0 or k_verify != k_draft or batch < 1:
            return
        bucket = batch_bucket(min(batch, self.max_batch))
        self.cost.observe(bucket, k_verify, seconds)
        self.steady_steps += 1
        if self.buckets[bucket].calibrated:
            self._choose(bucket)

    def _choose(self, bucket: int) -> None:
        tokens = self.acceptance.expected_tokens(self.cfg.optimism)
        seconds = self.cost.seconds[bucket]
        rates = [tokens[k] / seconds[k] if seconds[k] > 0 else -1.0 for k in range(self.max_k + 1)]
        self.buckets[bucket].best = int(np.argmax(rates))

    # --- reporting -------------------------------------------------------------------

    def state(self) -> dict:
        """JSON-safe view for /specrl/status and /metrics."""
        tokens = self.acceptance.expected_tokens()
        return {"max_k": self.max_k, "steps": self.steps, "steady_steps": self.steady_steps,
                "explored_steps": self.explored_steps, "last_k": self.last_choice,
                "chosen_k_counts": list(self.chosen_counts),
                "conditional_acceptance": [round(float(c), 4) for c in self.acceptance.conditional()],
                "expected_tokens_per_step": [round(float(t), 4) for t in tokens],
                "calibrated": any(b.calibrated for b in self.buckets),
                "buckets": {f"{2 ** i}-{min(2 ** (i + 1) - 1, self.max_batch)}": {
                    "best_k": b.best, "calibrated": b.calibrated,
                    "step_ms": [None if np.isnan(s) else round(1e3 * float(s), 3) for s in self.cost.seconds[i]],
                    "samples": [int(n) for n in self.cost.samples[i]]}
                    for i, b in enumerate(self.buckets)}}
