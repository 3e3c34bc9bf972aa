"""The online trainer's replay cap: at most ``replay_ratio`` samples per captured sequence, then it idles.

No engine: frames of the tiny target's shape go through a real ZeroMQ sender
to the trainer's receiver, as the worker tap would send them.
"""

from __future__ import annotations

import time

import pytest
import torch

from vllm_specrl.capture.sender import CaptureSender
from vllm_specrl.proposer.checkpoint import init_draft
from vllm_specrl.launcher import free_port
from vllm_specrl.trainer.online import OnlineConfig, OnlineDraftTrainer


def send_sequences(address: str, n: int, rows: int, hidden: int, policy_version: int = 0) -> CaptureSender:
    tx = CaptureSender(address)
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        tokens = torch.randint(0, 1000, (rows + 1,), generator=gen).tolist()
        tx.offer({"request_id": f"req-{i}", "positions": list(range(rows)), "token_ids": tokens[:-1],
                  "next_token_ids": tokens[1:], "policy_version": policy_version, "step": 0},
                 {"aux_hidden": torch.randn(rows, 3 * hidden, generator=gen).to(torch.bfloat16),
                  "final_hidden": torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)})
    return tx


def trainer_on_frames(tiny_model, tmp_path, **config) -> tuple[OnlineDraftTrainer, str]:
    """An online trainer on a fresh tiny-target draft, listening on a free port (its address returned);
    quick settings (``config`` overrides them): batch 4, a sequence is done after 0.2 s quiet, no publish or
    checkpoint."""
    init_draft(tiny_model, tmp_path / "draft", 1024, seed=0)
    address = f"tcp://127.0.0.1:{free_port()}"
    cfg = OnlineConfig(**{"capture": address, "batch_size": 4, "min_sequences": 4, "idle_s": 0.2,
                          "publish_every": 1000, "checkpoint_every": 1000, **config})
    return OnlineDraftTrainer(tmp_path / "draft", tiny_model, cfg, checkpoint_dir=tmp_path / "ckpt"), address


def test_replay_ratio_caps_training_then_new_data_resumes_it(tiny_model, tmp_path):
    trainer, address = trainer_on_frames(tiny_model, tmp_path, holdout_every=0, replay_ratio=1.0, max_seconds=4.0)
    try:
        tx = send_sequences(address, 8, 12, 256)
        first = trainer.run()
        assert trainer.ingested == 8
        assert first["steps"] == 2  # 8 sequences x ratio 1 / batch 4, then idle for the rest of 4 s
        tx.close()
        tx = send_sequences(address, 4, 12, 256)
        trainer.cfg.max_seconds = 3.0
        second = trainer.run()
        assert trainer.ingested == 12 and second["steps"] == 3
        tx.close()
    finally:
        trainer.close()


def test_without_a_cap_it_trains_continuously(tiny_model, tmp_path):
    trainer, address = trainer_on_frames(tiny_model, tmp_path, holdout_every=0, max_seconds=4.0)
    try:
        tx = send_sequences(address, 8, 12, 256)
        t0 = time.time()
        result = trainer.run()
        assert result["steps"] > 2 and time.time() - t0 >= 3.5
        tx.close()
    finally:
        trainer.close()


def test_a_pause_file_stops_training_but_not_ingest(tiny_model, tmp_path):
    """While the RL loop's pause file exists the trainer takes in frames and makes no step; once it is
    gone, the same run trains on what arrived meanwhile."""
    pause = tmp_path / "trainer.pause"
    pause.touch()
    trainer, address = trainer_on_frames(tiny_model, tmp_path, holdout_every=0, max_seconds=2.0,
                                         pause_file=str(pause))
    try:
        tx = send_sequences(address, 8, 12, 256)
        paused = trainer.run()
        assert trainer.ingested == 8 and paused["steps"] == 0, paused
        pause.unlink()
        resumed = trainer.run()
        assert resumed["steps"] > 2, resumed
        tx.close()
    finally:
        trainer.close()


@pytest.mark.parametrize("keep_versions", [1, 2])
def test_the_buffer_keeps_the_rollouts_of_the_last_keep_versions_policy_versions(tiny_model, tmp_path, keep_versions):
    """``keep_versions`` 1 drops a version's rollouts as soon as the policy moves; 2 keeps them one version more
    (still trainable: a train step draws from them), then drops them."""
    trainer, address = trainer_on_frames(tiny_model, tmp_path, holdout_every=0, replay_ratio=1.0, max_seconds=3.0,
                                         keep_versions=keep_versions)
    try:
        tx = send_sequences(address, 8, 12, 256)
        trainer.run()
        assert len(trainer.buffer) == 8
        trainer.on_policy_version(1)
        assert len(trainer.buffer) == (8 if keep_versions == 2 else 0)
        if keep_versions == 2:
            assert {s["policy_version"] for s in trainer.buffer} == {0}
            before = trainer.trainer.step_count
            trainer.train_step()
            assert trainer.trainer.step_count == before + 1
        trainer.on_policy_version(2)
        assert len(trainer.buffer) == 0
        tx.close()
    finally:
        trainer.close()
