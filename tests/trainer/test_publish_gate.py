"""The publish gate: a draft reaches the engine only if held-out rollouts say it serves better.

Estimates are the trainer's exact expectation of vLLM's counters (checked against
the engine in test_estimate_check.py), computed here on the warm draft's held-out
rollouts of the tiny target (HF features, float32), and compared with the same
estimate made by an independent trainer holding the expected weights. The
online trainer's side (which rollouts are held out, ageing by policy version, an
engine that lost the published draft) runs on frames sent through a real
ZeroMQ socket, as the worker tap sends them.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_online_replay import send_sequences, trainer_on_frames
from vllm_specrl.proposer.checkpoint import init_draft, load_draft, target_lm_head
from vllm_specrl.trainer.core import DraftTrainer, TrainConfig
from vllm_specrl.trainer.features import sequence_features
from vllm_specrl.trainer.publish_gate import GateConfig, PublishGate


@pytest.fixture(scope="module")
def rollouts(tiny_model, warm_draft):
    """The warm start's held-out rollouts (prompts it never trained on) and two of its training
    rollouts, with the target's features."""
    from transformers import AutoModelForCausalLM

    saved = json.loads((warm_draft / "warm_start_rollouts.json").read_text())
    eval_prompts = set(saved["eval_prompts"])
    held = [i for i, p in enumerate(saved["prompt_index"]) if p in eval_prompts][:16]
    trained = [i for i, p in enumerate(saved["prompt_index"]) if p not in eval_prompts][:2]
    target = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    features = sequence_features(target, [saved["sequences"][i] for i in held + trained],
                                 load_draft(warm_draft, tiny_model).shape.aux_layer_ids, dtype=torch.float32,
                                 prompt_lengths=[saved["prompt_lengths"][i] for i in held + trained])
    return features[:len(held)], features[len(held):]


def trainer_for(draft_dir, tiny_model, lr: float = 1e-3) -> DraftTrainer:
    return DraftTrainer(load_draft(draft_dir, tiny_model), target_lm_head(tiny_model), TrainConfig(lr=lr, ttt_steps=3))


def gate_over(trainer, sequences) -> PublishGate:
    gate = PublishGate(trainer, GateConfig(every=1, min_sequences=4))
    for seq in sequences:
        assert gate.take(seq, policy_version=0)
    return gate


def test_an_overfitted_candidate_is_held_and_the_served_estimate_is_the_served_drafts(tiny_model, warm_draft,
                                                                                     rollouts):
    held_out, few = rollouts
    trainer = trainer_for(warm_draft, tiny_model, lr=1e-2)
    gate = gate_over(trainer, held_out)
    for _ in range(30):  # the online failure: a warm draft fine-tuned hard on a handful of rollouts
        trainer.train_on(few)
    overfitted = {k: v.clone() for k, v in trainer.drafter_module.state_dict().items()}
    verdict = gate.decide()
    reference = trainer_for(warm_draft, tiny_model).held_out_acceptance(held_out)
    assert verdict["served_acceptance_length"] == pytest.approx(reference, abs=1e-5), verdict
    assert verdict["candidate_acceptance_length"] < reference - 0.1, (verdict, reference)
    assert verdict["publish"] is False and verdict["reason"] == "not_better"
    # The served weights were swapped in for their estimate and the candidate's put back.
    for k, v in trainer.drafter_module.state_dict().items():
        assert torch.equal(v, overfitted[k]), k
    assert trainer.held_out_acceptance(held_out) == pytest.approx(verdict["candidate_acceptance_length"], abs=1e-6)


def test_a_better_candidate_is_published_and_becomes_the_draft_to_beat(tiny_model, warm_draft, rollouts, tmp_path):
    held_out, _ = rollouts
    init_draft(tiny_model, tmp_path / "fresh", 1024, seed=3)
    trainer = trainer_for(tmp_path / "fresh", tiny_model)
    gate = gate_over(trainer, held_out)  # serves the fresh draft
    trainer.drafter_module.load_state_dict(load_draft(warm_draft, tiny_model).state_dict())
    verdict = gate.decide()
    assert verdict["publish"] is True, verdict
    assert verdict["served_acceptance_length"] == pytest.approx(
        trainer_for(tmp_path / "fresh", tiny_model).held_out_acceptance(held_out), abs=1e-5)
    assert verdict["candidate_acceptance_length"] > verdict["served_acceptance_length"] + 0.3, verdict
    gate.published(verdict)
    again = gate.decide()  # the same draft is not better than itself
    assert again["publish"] is False and again["served_acceptance_length"] == verdict["candidate_acceptance_length"]
    assert gate.status() == {"held_out": len(held_out), "offered": len(held_out), "better": 1, "not_better": 1,
                             "too_few_held_out": 0}


def test_too_few_held_out_rollouts_keep_the_served_draft(tiny_model, warm_draft, rollouts):
    held_out, _ = rollouts
    gate = PublishGate(trainer_for(warm_draft, tiny_model), GateConfig(every=2, min_sequences=4))
    taken = [gate.take(seq, policy_version=0) for seq in held_out[:7]]
    assert taken == [False, True, False, True, False, True, False]
    assert gate.decide() == {"held_out": 3, "publish": False, "reason": "too_few_held_out"}


def fake_engine(draft_versions: list[int]):
    class Client:
        def statuses(self):
            return {f"http://replica-{i}": (True, {"versions": {"draft": v}}) for i, v in enumerate(draft_versions)}
    return Client()


def test_the_online_trainer_holds_out_every_nth_rollout_and_ages_them_by_policy_version(tiny_model, tmp_path):
    trainer, address = trainer_on_frames(tiny_model, tmp_path, replay_ratio=1.0, max_seconds=3.0, holdout_every=4)
    try:
        tx = send_sequences(address, 12, 12, 256)
        trainer.run()
        assert trainer.ingested == 12 and len(trainer.gate.held_out) == 3 and len(trainer.buffer) == 9
        held = {id(s) for _, s in trainer.gate.held_out}
        assert not held & {id(s) for s in trainer.buffer}
        # Training drew only from the buffer: the replay budget is 9 samples (ratio 1), 3 steps of 4.
        assert trainer.trainer.step_count == 3 and trainer.version_trained == 12
        trainer.on_policy_version(1)
        assert len(trainer.gate.held_out) == 3 and trainer.version_buffered == 0  # the previous version stays
        trainer.on_policy_version(2)
        assert len(trainer.gate.held_out) == 0  # two versions back: gone
        tx.close()
        assert not trainer.engine_lost_draft()  # nothing published yet
        trainer.draft_version = 3
        trainer.client = fake_engine([3, 3])
        assert not trainer.engine_lost_draft()
        trainer.client = fake_engine([3, 0])  # one replica restarted from the checkpoint on disk
        assert trainer.engine_lost_draft()
    finally:
        trainer.client = None
        trainer.close()


def hold_every_candidate(trainer) -> list[int]:
    """Make the trainer's gate hold every candidate as not better; returns the steps of its verdicts."""
    verdicts: list[int] = []

    def not_better() -> dict:
        verdicts.append(trainer.trainer.step_count)
        return {"publish": False, "reason": "not_better", "held_out": 4}

    trainer.gate.decide = not_better
    return verdicts


@pytest.mark.parametrize("rest_after_hold", [True, False])
def test_a_held_candidate_is_dropped_and_the_trainer_rests_until_the_policy_moves(tiny_model, tmp_path,
                                                                                   rest_after_hold):
    """After a "not better" verdict the trainer serves nothing new, so it goes back to the served weights
    (fresh optimizer) and makes no step until a new policy version; without rest it trains on."""
    trainer, address = trainer_on_frames(tiny_model, tmp_path, holdout_every=4, publish_every=2, max_seconds=3.0,
                                         rest_after_hold=rest_after_hold)
    served = {k: v.clone() for k, v in trainer.gate.served_state.items()}
    verdicts = hold_every_candidate(trainer)
    try:
        tx = send_sequences(address, 12, 12, 256)
        result = trainer.run()  # no replay cap: it would train for all 3 s
        state = trainer.gate._snapshot()
        if not rest_after_hold:
            assert result["steps"] > 2 and len(verdicts) > 1
            assert any(not torch.equal(state[k], served[k]) for k in served)
            return
        assert result["steps"] == 2 and verdicts == [2] and trainer.rests == 1 and trainer.resting()
        assert all(torch.equal(state[k], served[k]) for k in served)  # the held candidate is gone
        assert not trainer.trainer.optimizer.state
        assert trainer.report()["rests"] == 1
        trainer.on_policy_version(1)  # the policy moved: training resumes from the served weights
        assert not trainer.resting()
        tx.close()
        tx = send_sequences(address, 8, 12, 256, policy_version=1)
        trainer.cfg.max_seconds = 2.0
        assert trainer.run()["steps"] == 4 and verdicts == [2, 4] and trainer.rests == 2
    finally:
        tx.close()
        trainer.close()


def test_a_rest_ends_after_enough_fresh_rollouts_under_the_same_policy(tiny_model, tmp_path):
    """An engine whose policy never moves (online adaptation while serving) must not keep the first held
    candidate's verdict for good: ``rest_sequences`` newly captured rollouts end the rest; fewer do not."""
    trainer, address = trainer_on_frames(tiny_model, tmp_path, holdout_every=4, publish_every=2, max_seconds=3.0,
                                         rest_sequences=8)
    verdicts = hold_every_candidate(trainer)
    txs = []
    try:
        txs.append(send_sequences(address, 12, 12, 256))
        assert trainer.run()["steps"] == 2 and verdicts == [2] and trainer.resting()
        txs.append(send_sequences(address, 4, 12, 256))  # 4 fresh rollouts: still resting
        trainer.cfg.max_seconds = 2.0
        assert trainer.run()["steps"] == 2 and trainer.ingested == 16 and trainer.resting()
        txs.append(send_sequences(address, 4, 12, 256))  # 8 since the rest began: train again, same policy
        assert trainer.run()["steps"] == 4 and verdicts == [2, 4] and trainer.rests == 2
        assert trainer.policy_version == 0 and trainer.resting()  # the second verdict began a second rest
    finally:
        for tx in txs:
            tx.close()
        trainer.close()


def test_holds_in_a_row_lengthen_the_rest_and_a_publish_resets_it(tiny_model, tmp_path):
    """Each hold in a row doubles the policy versions (and fresh rollouts) the next rest spans, up to
    ``rest_backoff_max``: a trainer that cannot beat the served draft stops spending shared cores on
    every version; a published draft puts it back to one version."""
    trainer, address = trainer_on_frames(tiny_model, tmp_path, holdout_every=4, publish_every=2, max_seconds=2.0,
                                         rest_sequences=8, rest_backoff_max=4)
    tx = None
    try:
        trainer.on_policy_version(0)

        def resting_through(versions: range) -> list[bool]:
            states = []
            for version in versions:
                trainer.on_policy_version(version)
                states.append(trainer.resting())
            return states

        trainer.rest()  # first hold at version 0: the next version ends it
        assert trainer.rest_span() == 1 and resting_through(range(1, 2)) == [False]
        trainer.rest()  # second in a row, at version 1: two versions
        assert trainer.report()["rest_span_versions"] == 2
        assert resting_through(range(2, 4)) == [True, False]
        trainer.rest()  # third, at version 3: four
        assert resting_through(range(4, 8)) == [True, True, True, False]
        trainer.rest()  # fourth, at version 7: capped at four
        assert resting_through(range(8, 12)) == [True, True, True, False]
        trainer.rest()  # at version 11; fresh rollouts end a rest only at rest_sequences x the span (8 x 4)
        trainer.ingested += 31
        assert trainer.resting()
        trainer.ingested += 1
        assert not trainer.resting() and trainer.report()["rest_span_versions"] == 0
        # A candidate that wins is published (no engine here: the publish is a no-op that succeeds) and
        # the next hold rests one version again.
        trainer.gate.decide = lambda: {"publish": True, "reason": "better", "held_out": 4}
        tx = send_sequences(address, 12, 12, 256, policy_version=11)
        assert trainer.run()["steps"] >= 2 and trainer.holds_in_a_row == 0
        trainer.rest()
        assert trainer.rest_span() == 1 and resting_through(range(12, 13)) == [False]
    finally:
        if tx is not None:
            tx.close()
        trainer.close()


class RestartingReplica:
    """A one-replica fleet serving draft ``version`` (``restart()`` puts it back to the draft on disk,
    version 0), recording each draft pushed to it."""

    def __init__(self, version: int):
        self.version = version
        self.quarantined: dict[str, str] = {}
        self.active = {"http://replica-0": None}
        self.updates: list[tuple[int, dict]] = []

    def restart(self) -> None:
        self.version = 0

    def statuses(self):
        return {"http://replica-0": (True, {"versions": {"draft": self.version}, "spec_decode": {}})}

    def update_draft(self, state, version: int, trainer_report=None) -> dict:
        self.updates.append((version, {k: v.clone() for k, v in state.items()}))
        self.version = version
        return {"target": "draft", "version": version, "committed": list(self.active), "quarantined": {}}


def test_a_resting_trainer_gives_a_restarted_engine_the_served_draft(tiny_model, tmp_path):
    """Resting, the trainer reaches no publish point until the policy moves; an engine that restarts
    meanwhile serves the draft on disk, so the trainer pushes it the served draft (a newer version
    of the same weights) within ``lost_draft_check_s``, once, and keeps resting."""
    import threading

    trainer, address = trainer_on_frames(tiny_model, tmp_path, holdout_every=4, publish_every=2, max_seconds=3.0,
                                         lost_draft_check_s=0.2)
    trainer.gate.decide = lambda: {"publish": False, "reason": "not_better", "held_out": 4}
    served = {k: v.clone() for k, v in trainer.gate.served_state.items()}
    trainer.client, trainer.draft_version = RestartingReplica(version=1), 1
    trainer.log = open(tmp_path / "online.jsonl", "a")  # noqa: SIM115 - closed by trainer.close()
    restart = threading.Timer(1.5, trainer.client.restart)
    tx = send_sequences(address, 12, 12, 256)
    try:
        restart.start()
        result = trainer.run()
        assert result["steps"] == 2 and trainer.resting()
        assert [version for version, _ in trainer.client.updates] == [2] and trainer.draft_version == 2
        pushed = trainer.client.updates[0][1]
        assert all(torch.equal(pushed[k], served[k]) for k in served)
        trainer.log.flush()
        records = [json.loads(line) for line in (tmp_path / "online.jsonl").read_text().splitlines()]
        restored = [r for r in records if r.get("event") == "restore_lost_draft"]
        assert len(restored) == 1 and restored[0]["publish"]["version"] == 2, records
        assert restored[0]["time"] >= 1.5
    finally:
        restart.cancel()
        tx.close()
        trainer.client = None
        trainer.close()
