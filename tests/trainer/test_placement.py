"""Where the draft trainer runs: ``auto`` takes the GPU with the most free memory (never blindly the first,
which vLLM fills) and the CPU without one; explicit devices are checked against what is visible; the
choice reaches Accelerate, the CLI and the RL loop's trainer process; offline warm starts pass vLLM's
engine arguments through."""

from __future__ import annotations

import pytest

from vllm_specrl import cli
from vllm_specrl.cli import train_draft
from vllm_specrl.rl import draft_trainer
from vllm_specrl.trainer import placement
from vllm_specrl.trainer.core import DraftTrainer, TrainConfig


def test_auto_takes_the_gpu_with_the_most_free_memory():
    free = {0: 8 << 30, 1: 70 << 30, 2: 30 << 30}   # vLLM fills GPU 0 and part of 2
    assert placement.resolve_device("auto", cuda_count=3, free_bytes=free.__getitem__) == "cuda:1"
    assert placement.resolve_device("auto", cuda_count=0) == "cpu"


@pytest.mark.parametrize(("setting", "want"), [("cpu", "cpu"), ("cuda", "cuda:0"), ("cuda:2", "cuda:2")])
def test_an_explicit_device_is_taken_as_given(setting, want):
    assert placement.resolve_device(setting, cuda_count=4, free_bytes=lambda i: 0) == want


@pytest.mark.parametrize(("setting", "count", "message"), [("cuda:4", 4, "only 4"), ("cuda", 0, "no CUDA"),
                                                           ("gpu", 1, "must be auto")])
def test_a_device_that_is_not_there_is_an_error(setting, count, message):
    with pytest.raises(ValueError, match=message):
        placement.resolve_device(setting, cuda_count=count)


def test_the_trainer_trains_where_it_was_placed(tiny_model, monkeypatch, tmp_path):
    from vllm_specrl.proposer.checkpoint import init_draft, load_draft, target_lm_head

    monkeypatch.delenv(placement.DEVICE_ENV, raising=False)
    draft_dir = tmp_path / "draft"
    init_draft(tiny_model, draft_dir)
    trainer = DraftTrainer(load_draft(draft_dir, tiny_model), target_lm_head(tiny_model), TrainConfig(device="cpu"))
    assert str(trainer.accelerator.device) == "cpu" and next(trainer.unwrapped.parameters()).device.type == "cpu"
    assert placement.DEVICE_ENV in __import__("os").environ
    with pytest.raises(ValueError, match="no CUDA device"):
        DraftTrainer(load_draft(draft_dir, tiny_model), None, TrainConfig(device="cuda:0"))


def test_the_cli_and_the_rl_loop_pass_the_device(monkeypatch, capsys, tmp_path):
    parse = cli.build_parser().parse_args
    assert train_draft.train_config(parse(["train-draft", "--target", "t", "--draft", "d", "--device",
                                           "cpu"])).device == "cpu"
    monkeypatch.setattr("vllm_specrl.cpu.malloc.keep_every_block_on_heap", lambda: None)
    assert train_draft.run(parse(["train-draft", "--target", "t", "--draft", "d", "--offline",
                                       "--device", "cuda:3"])) == 2
    assert "--device" in capsys.readouterr().err
    assert train_draft.run(parse(["train-draft", "--target", "t", "--draft", "d", "--mtp", "--capture",
                                       "tcp://127.0.0.1:1", "--device", "cuda:0"])) == 2
    assert "--mtp trains on the CPU" in capsys.readouterr().err
    seen = {}

    def fake_start(cmd, **kwargs):
        seen["cmd"] = cmd
        raise RuntimeError("not started")
    monkeypatch.setattr(draft_trainer, "start_niced", fake_start)
    with pytest.raises(RuntimeError):
        draft_trainer.DraftTrainerProcess.start("tcp://127.0.0.1:1", "http://127.0.0.1:2", "d", "t", tmp_path,
                                                draft_trainer.DraftTrainerSettings(device="cuda:1"))
    assert seen["cmd"][seen["cmd"].index("--device") + 1] == "cuda:1"


def test_offline_warm_starts_pass_vllms_engine_arguments(monkeypatch, tmp_path, tiny_model):
    from vllm_specrl.trainer import offline

    monkeypatch.setattr("vllm_specrl.cpu.malloc.keep_every_block_on_heap", lambda: None)
    seen = {}
    monkeypatch.setattr(offline, "warm_start", lambda target, draft, prompts, cfg,
                        *a: seen.setdefault("cfg", cfg) and {})
    args = cli.build_parser().parse_args(["train-draft", "--offline", "--target", str(tmp_path), "--draft",
                                          str(tmp_path / "d"), "--engine-args",
                                          '{"tensor_parallel_size": 8, "gpu_memory_utilization": 0.5}'])
    assert args.func(args) in (0, None)
    assert seen["cfg"].engine_args == {"tensor_parallel_size": 8, "gpu_memory_utilization": 0.5}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen["llm"] = kwargs
            raise RuntimeError("stop here")
    import vllm
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    cfg = offline.OfflineConfig(engine_args={"tensor_parallel_size": 8, "max_model_len": 4096})
    with pytest.raises(RuntimeError, match="stop here"):
        offline.generate_rollouts(tiny_model, [], cfg)
    assert seen["llm"]["tensor_parallel_size"] == 8 and seen["llm"]["max_model_len"] == 4096
    assert seen["llm"]["enforce_eager"] is True   # a default the user did not override
