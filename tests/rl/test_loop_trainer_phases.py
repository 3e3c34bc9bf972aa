"""``GRPOLoop``'s schedule for the online draft trainer: when it trains and when it only ingests.

The engine, the policy and the trainer are stand-ins that record the trainer's state at each phase
(the loop's order is what is tested; ``test_loop.py`` runs it against a served engine). What would
fail: a trainer left training through the phase it should leave to the others, or left paused for good.
"""

from __future__ import annotations

import pytest

from vllm_specrl.rl.loop import GRPOLoop

COUNTERS = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}


class Trainer:
    def __init__(self):
        self.paused = False
        self.paused_between_steps: list[bool] = []

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


class Engine:
    def __init__(self, seen: list, trainer: Trainer):
        self.seen, self.trainer = seen, trainer

    def status(self) -> dict:
        return {"spec_decode": COUNTERS}

    def update_policy(self, *args, **kwargs) -> None:
        self.seen.append(("sync", self.trainer.paused))


class Policy:
    version = 0

    def __init__(self, seen: list, trainer: Trainer):
        self.seen, self.trainer = seen, trainer
        self.model = self

    def named_parameters(self):
        return iter(())

    def grpo_pass(self, samples, group, clip):
        self.seen.append(("policy", self.trainer.paused))
        return [], 0.0, 0.0, 0.0


def run_steps(steps: int, **kwargs) -> tuple[list, Trainer]:
    seen: list = []
    trainer = Trainer()
    loop = GRPOLoop(Engine(seen, trainer), "m", Policy(seen, trainer), lambda i: [("p", None)], lambda t, a: 0.0,
                    steps=steps, group=2, draft_trainer=trainer, **kwargs)

    def rollouts(i):
        seen.append(("rollouts", trainer.paused))
        return [{"rollout_id": f"{i}/0/{j}"} for j in range(2)], {}

    loop.rollouts = rollouts
    with loop:
        for i in range(steps):
            loop.step(i)
            trainer.paused_between_steps.append(trainer.paused)
    return seen, trainer


def test_by_default_the_trainer_trains_during_the_rollouts_and_pauses_for_the_policy_phases():
    seen, trainer = run_steps(2)
    assert seen == [("rollouts", False), ("policy", True), ("sync", True)] * 2
    assert trainer.paused_between_steps == [True, True]


def test_trained_during_the_policy_phases_it_pauses_for_the_rollouts():
    seen, trainer = run_steps(2, trainer_trains_during="policy")
    assert seen == [("rollouts", True), ("policy", False), ("sync", False)] * 2
    # Paused from each step's end: whatever runs between steps (another engine's turn) gets the cores.
    assert trainer.paused_between_steps == [True, True]


def test_training_during_the_policy_phases_is_refused_where_rollouts_overlap_them():
    with pytest.raises(ValueError, match="policy_lag"):
        run_steps(1, trainer_trains_during="policy", policy_lag=1)
    with pytest.raises(ValueError, match="'rollouts' or 'policy'"):
        run_steps(1, trainer_trains_during="sync")
