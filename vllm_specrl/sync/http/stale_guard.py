"""Stale-draft guard: say plainly when the draft no longer helps after a policy update.

Two signals, both reported by ``/specrl/status`` and as Prometheus gauges:
the draft's version lags the policy's by more than ``max_version_lag``, or,
since the last policy update, at least ``min_drafts`` drafts were verified
and none of their tokens was accepted (the silent failure after a refit).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from vllm_specrl.metrics import SpecDecodeCounters

MAX_VERSION_LAG_ENV, MIN_DRAFTS_ENV = "VLLM_SPECRL_MAX_DRAFT_LAG", "VLLM_SPECRL_STALE_MIN_DRAFTS"


def _from_env(name: str, default: int) -> int:
    """The switch's value when a guard is made (not when this module is imported)."""
    return int(os.environ.get(name, str(default)))


@dataclass
class StaleDraftGuard:
    max_version_lag: int = field(default_factory=lambda: _from_env(MAX_VERSION_LAG_ENV, 2))
    min_drafts: int = field(default_factory=lambda: _from_env(MIN_DRAFTS_ENV, 64))
    baseline: SpecDecodeCounters | None = None

    def policy_updated(self, counters: SpecDecodeCounters) -> None:
        """Start a new acceptance window at a policy commit."""
        self.baseline = counters

    def assess(self, policy_version: int, draft_version: int, has_draft: bool,
               counters: SpecDecodeCounters, draft_is_policy: bool = False) -> dict:
        """``draft_is_policy``: the draft is the policy's own MTP layers, updated with it (no lag)."""
        window = counters.minus(self.baseline) if self.baseline else counters
        reasons = []
        lag = 0 if draft_is_policy else policy_version - draft_version
        if has_draft and lag > self.max_version_lag:
            reasons.append(f"draft version {draft_version} lags policy version {policy_version} "
                           f"by {lag} (> {self.max_version_lag})")
        if has_draft and window.num_drafts >= self.min_drafts and window.num_accepted_tokens == 0:
            reasons.append(f"0 draft tokens accepted over the last {int(window.num_drafts)} drafts "
                           "since the policy update")
        return {"stale": bool(reasons), "reasons": reasons, "version_lag": lag,
                "window": window.summary(), "max_version_lag": self.max_version_lag,
                "min_drafts": self.min_drafts}
