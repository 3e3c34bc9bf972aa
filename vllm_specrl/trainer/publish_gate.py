"""Publish a draft only when held-out rollouts say it serves better than the one the engine has.

The online trainer learns from a handful of rollouts per policy version (16 in the
demo) and replays them several times: its in-sample estimate of the acceptance it
will earn runs ahead of what the engine then measures, and a fine-tuned warm draft
can serve worse than the draft it replaces (measured in the RL demo: served
acceptance length 1.72 -> 1.57 with the trainer publishing every 4 steps, 1.73 ->
1.68 frozen). The gate keeps every ``every``-th captured rollout out of training
and, at each publish, estimates vLLM's acceptance length for the candidate and for
the draft the engine serves on those same held-out rollouts
(``trainer.acceptance``'s exact expectation of the engine's counters); the candidate
is pushed only if it is ahead by more than ``margin``.

Held-out rollouts of the current and the previous policy version are kept (the
policy moves little per RL step; one version alone is a handful of rollouts and a
noisy verdict), the oldest dropped past ``capacity``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class GatedTrainer(Protocol):
    """What the gate needs of a draft trainer (``DraftTrainer`` and ``MTPTrainer`` have it)."""

    @property
    def drafter_module(self) -> torch.nn.Module: ...

    def held_out_acceptance(self, sequences: list[dict[str, Any]]) -> float: ...


@dataclass
class GateConfig:
    every: int = 4          # hold out every n-th ingested rollout (0: no gate, publish on schedule)
    capacity: int = 32      # held-out rollouts kept (current and previous policy version)
    min_sequences: int = 4  # fewer held-out rollouts than this: keep the served draft
    margin: float = 0.0     # the candidate must beat the served estimate by more than this


class PublishGate:
    def __init__(self, trainer: GatedTrainer, config: GateConfig):
        self.trainer = trainer
        self.config = config
        self.held_out: deque[tuple[int | None, dict[str, Any]]] = deque(maxlen=config.capacity)
        self.offered = 0
        self.served_state = self._snapshot()
        self._served_estimate: tuple[int, float] | None = None  # (revision of held_out, estimate)
        self._revision = 0
        self.decisions = {"better": 0, "not_better": 0, "too_few_held_out": 0}

    @property
    def enabled(self) -> bool:
        return self.config.every > 0

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """The module's state but its frozen parameters (EAGLE-3's embedding is the target's, the same
        in both drafts: an 8B target's would be gigabytes to copy for nothing); buffers such as the
        draft-vocabulary map are kept."""
        module = self.trainer.drafter_module
        frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
        return {k: v.detach().clone() for k, v in module.state_dict().items() if k not in frozen}

    def take(self, sequence: dict[str, Any], policy_version: int | None) -> bool:
        """Offer a rollout; True when the gate keeps it (it must then not be trained on)."""
        if not self.enabled:
            return False
        self.offered += 1
        if self.offered % self.config.every:
            return False
        self.held_out.append((policy_version, sequence))
        self._revision += 1
        return True

    def on_policy_version(self, version: int) -> None:
        """Drop held-out rollouts older than the previous policy version."""
        kept = [(v, s) for v, s in self.held_out if v is not None and v >= version - 1]
        if len(kept) != len(self.held_out):
            self.held_out = deque(kept, maxlen=self.config.capacity)
            self._revision += 1

    def _served_acceptance(self, sequences: list[dict[str, Any]]) -> float:
        """The served draft's estimate: its weights swapped into the trainer's module for the evaluation."""
        if self._served_estimate is not None and self._served_estimate[0] == self._revision:
            return self._served_estimate[1]
        module = self.trainer.drafter_module
        candidate = self._snapshot()
        try:
            module.load_state_dict(self.served_state, strict=False)
            estimate = self.trainer.held_out_acceptance(sequences)
        finally:
            module.load_state_dict(candidate, strict=False)
        self._served_estimate = (self._revision, estimate)
        return estimate

    def decide(self) -> dict[str, Any]:
        """Whether to publish the trainer's draft now, with the estimates behind the verdict."""
        sequences = [s for _, s in self.held_out]
        verdict: dict[str, Any] = {"held_out": len(sequences)}
        if len(sequences) < self.config.min_sequences:
            verdict.update(publish=False, reason="too_few_held_out")
            self.decisions["too_few_held_out"] += 1
            return verdict
        served = self._served_acceptance(sequences)
        candidate = self.trainer.held_out_acceptance(sequences)
        publish = candidate > served + self.config.margin
        reason = "better" if publish else "not_better"
        verdict.update(publish=publish, reason=reason,
                       candidate_acceptance_length=candidate, served_acceptance_length=served)
        self.decisions[reason] += 1
        return verdict

    def published(self, verdict: dict[str, Any] | None) -> None:
        """The candidate reached the engine: it is now the draft to beat."""
        self.served_state = self._snapshot()
        if verdict is not None and "candidate_acceptance_length" in verdict:
            self._served_estimate = (self._revision, verdict["candidate_acceptance_length"])
        else:
            self._served_estimate = None

    def revert(self) -> None:
        """Put the served draft's weights back into the trainer's module (a held candidate is dropped)."""
        self.trainer.drafter_module.load_state_dict(self.served_state, strict=False)

    def status(self) -> dict[str, Any]:
        return {"held_out": len(self.held_out), "offered": self.offered, **self.decisions}
