"""``rl.loop.GRPOLoop``: the step order of a GRPO job, run as a user runs it (``examples/grpo_loop.py``, the
user's own task and reward, an EAGLE-3 engine with the online draft trainer) and with policy lag 1.

What would fail: rollouts tagged with the wrong policy version, an update that does not reach the
engine (the next step's on-policy logprobs then differ from the trainer's far beyond float32
numerics), a step that speculates nothing, a lag-1 loop that does not overlap the next rollouts with
training, or an async loop that requests rollouts past its last step.

Engines: two ``vllm serve`` (tiny model, float32): the example's (EAGLE-3, capture, adaptive k,
a ``train-draft`` beside it) and a plain one for the lag-1 loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def test_the_worked_example_runs_a_user_written_loop(tiny_model, tmp_path):
    from vllm_specrl.proposer.checkpoint import init_draft

    init_draft(tiny_model, tmp_path / "draft", seed=0)
    # A learning rate at which one step moves the tiny model's logprobs far beyond float32's noise,
    # so an update that failed to land would show in the next step's on-policy comparison.
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "grpo_loop.py"), "--policy", str(tiny_model),
                           "--draft", str(tmp_path / "draft"), "--work-dir", str(tmp_path / "work"),
                           "--steps", str(STEPS), "--lr", "1e-3", "--max-tokens", "16"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    steps, final = lines[:-1], lines[-1]["final_status"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        assert s["sampled_by"] == [s["step"]] and s["policy_version"] == s["step"] + 1, s
        assert s["drafts"] > 0 and s["acceptance_length"] >= 1.0, s
        assert s["on_policy_logprob_abs_diff_max"] < 2e-3, s  # float32: the served weights are the trained ones
    assert final["versions"]["policy"] == STEPS
    assert final["spec_decode"]["num_drafts"] == sum(s["drafts"] for s in steps)


def test_policy_lag_one_overlaps_the_next_rollouts_with_training(tiny_model, tmp_path):
    from vllm_specrl.rl.loop import GRPOLoop
    from vllm_specrl.rl.policy import Policy
    from vllm_specrl.rl.serving import serve_args
    from vllm_specrl.launcher import VLLMServer
    from vllm_specrl.sync.clients.engine_client import EngineClient

    requested: list[int] = []

    def tasks(i: int) -> list[tuple[str, int]]:
        requested.append(i)
        return [(f"Count to {i + n}:", i + n) for n in range(2)]

    policy = Policy(tiny_model, lr=1e-3, seed=0)
    with VLLMServer(tiny_model, serve_args("plain", dtype="float32", max_model_len=512).args,
                    log_path=tmp_path / "serve.log") as server:
        engine = EngineClient(server.url, progress=False)
        with GRPOLoop(engine, server.model, policy, tasks, lambda text, answer: float(str(answer) in text),
                      steps=STEPS, group=2, max_tokens=48, policy_lag=1) as loop:
            results = [loop.step(i) for i in range(STEPS)]
        assert engine.status()["versions"]["policy"] == STEPS
    assert requested == list(range(STEPS))  # nothing requested past the last step
    for r in results:
        assert r.trained_version == r.step and len(r.samples) == 4
        for s in r.samples:
            # requested before step i - 1's update landed (while it trained), finished by its end at the latest
            assert s["policy_version_start"] == max(0, r.step - 1), s
            assert s["policy_version_start"] <= s["policy_version_end"] <= r.step, s
    assert results[0].on_policy == [True] * 4


def test_the_on_policy_logprob_difference_leaves_out_samples_of_another_version():
    """Only samples drawn wholly under the trained version count: a sample spanning two versions (lag 1) would
    read far off without anything being wrong. No engine."""
    import torch

    from vllm_specrl.rl.loop import StepResult

    samples = [{"vllm_logprobs": [-1.0, -2.0], "policy_version_start": 3, "policy_version_end": 3},
               {"vllm_logprobs": [-1.0], "policy_version_start": 2, "policy_version_end": 3}]
    result = StepResult(0, samples, {}, 0.0, [torch.tensor([-1.0, -2.5]), torch.tensor([-4.0])], 0.0, 0.0, 0.0,
                        0.0, 0.0, 3, {}, {}, {})
    (diff,) = result.on_policy_logprob_abs_diff()
    assert torch.equal(diff, torch.tensor([0.0, 0.5]))
    assert len(result.logprob_abs_diff()) == 2


def test_each_steps_logprob_difference_is_reported_to_the_engine():
    """``GRPOLoop.report_logprobs``: the on-policy tokens' largest and mean |difference| go to the engine
    (``/specrl/status`` ``logprob_conformance``), a failing report never stops the step. No engine."""
    import torch

    from vllm_specrl.rl.loop import GRPOLoop, StepResult

    sent = []
    samples = [{"vllm_logprobs": [-1.0, -2.0], "policy_version_start": 3, "policy_version_end": 3},
               {"vllm_logprobs": [-1.0], "policy_version_start": 2, "policy_version_end": 3}]
    result = StepResult(5, samples, {}, 0.0, [torch.tensor([-1.0, -2.5]), torch.tensor([-4.0])], 0.0, 0.0, 0.0,
                        0.0, 0.0, 3, {}, {}, {})
    loop = GRPOLoop.__new__(GRPOLoop)
    loop.engine = type("Engine", (), {"report_logprobs": lambda self, report: sent.append(report)})()
    report = loop.report_logprobs(result)
    assert sent == [report] and report == {"step": 5, "policy_version": 3, "tokens": 2, "samples": 1, "max": 0.5,
                                           "mean": 0.25}

    def refuse(report):
        raise ConnectionError("engine gone")

    loop.engine = type("Engine", (), {"report_logprobs": lambda self, report: refuse(report)})()
    assert loop.report_logprobs(result)["max"] == 0.5
