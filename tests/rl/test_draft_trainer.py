"""``rl.draft_trainer``: the online draft trainer started beside an engine's capture stream as an RL loop
starts it (low priority, where the engine leaves CPUs), paused and resumed through its pause file, and
stopped with a checkpoint; a trainer that cannot start is an error, not a hang.

Engines: none; two ``train-draft`` processes (the tiny fixture's draft and target), one that starts
and one that cannot."""

from __future__ import annotations

import json
import os

import pytest

from vllm_specrl.rl.draft_trainer import DraftTrainerProcess, DraftTrainerSettings, trainer_cpus
from vllm_specrl.launcher import free_port


def test_trainer_cpus_follow_the_capture_sender():
    assert trainer_cpus("auto", {"capture": {"sender_cpus": [1]}}) == {1}
    assert trainer_cpus("auto", {"capture": None}) is None  # a GPU worker: anywhere
    assert trainer_cpus("any", {"capture": {"sender_cpus": [1]}}) is None


def test_a_trainer_started_without_a_pause_file_refuses_to_pause(tmp_path):
    """A loop that pauses it (``GRPOLoop(trainer_trains_during="policy")``) must not believe it paused a
    trainer that trains on regardless."""
    trainer = DraftTrainerProcess(None, tmp_path, "spec", pausable=False)
    with pytest.raises(RuntimeError, match="pause file"):
        trainer.pause()
    assert not trainer.pause_file.exists()
    trainer.resume()  # nothing to undo


def test_a_trainer_starts_pauses_resumes_and_stops_with_a_checkpoint(tiny_model, tmp_path):
    from vllm_specrl.proposer.checkpoint import init_draft

    init_draft(tiny_model, tmp_path / "draft", seed=0)
    settings = DraftTrainerSettings(mixed_precision="no", niceness=10, sched_idle=False)
    trainer = DraftTrainerProcess.start(f"tcp://127.0.0.1:{free_port()}", "http://127.0.0.1:9", tmp_path / "draft",
                                        tiny_model, tmp_path / "work", settings, cpus={0})
    try:
        assert os.getpriority(os.PRIO_PROCESS, trainer.proc.pid) == 10
        assert os.sched_getaffinity(trainer.proc.pid) == {0}
        trainer.pause()
        assert trainer.pause_file.exists()
        trainer.resume()
        assert not trainer.pause_file.exists()
    finally:
        assert trainer.stop(60)  # exits by itself on SIGINT
    started = json.loads(trainer.output.read_text().splitlines()[0])
    assert started["event"] == "started" and (tmp_path / "work" / "draft-online-spec").exists()


def test_a_trainer_that_cannot_start_is_an_error(tiny_model, tmp_path):
    with pytest.raises(RuntimeError, match="did not start"):
        DraftTrainerProcess.start(f"tcp://127.0.0.1:{free_port()}", "http://127.0.0.1:9", tmp_path / "missing",
                                  tiny_model, tmp_path / "work", DraftTrainerSettings(mixed_precision="no"))
