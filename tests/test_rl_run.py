"""``scripts/rl_run.py --quick`` end to end on the tiny fixture: the staleness run's mechanics, not its
numbers. Plain, frozen and online arms on two seeds with a task switch part way: the policy moves (KL from
the start grows), every speculative step records vLLM's served counters, the online trainer's publishes
reach the engine (draft versions rise, on schedule: no gate that passes only sometimes), the frozen draft
stays at version 0, the RL-level lossless test compares the reward curves, the logprob check runs, and the
JSON and plot are written. Planted once: ``--block-publishes`` (the trainer never publishes) fails
``test_the_online_drafts_publishes_reach_the_engine``.

Engines: six `vllm serve` runs (three arms x two seeds, each its own process as the benchmark runs them)
and one online draft trainer per online run; one module-scoped benchmark run serves every test (slow tier).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.fixture(scope="module")
def report(tiny_model, warm_draft, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_run")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "rl_run.py"), "--quick", "--target", str(tiny_model),
         "--draft", str(warm_draft), "--dtype", "float32", "--lr", "1e-3", "--out", str(out)],
        capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "rl_run.json").read_text()), out


def test_every_arm_and_seed_ran_every_step_through_the_switch(report):
    data, _ = report
    assert sorted((r["arm"], r["seed"]) for r in data["runs"]) == [
        (a, s) for a in ("frozen", "online", "plain") for s in (0, 1)]
    for run in data["runs"]:
        assert [s["task"] for s in run["steps"]] == ["concise"] * 3 + ["concise-minus"] * 3
        assert [s["policy_version"] for s in run["steps"]] == list(range(6))  # versions as served, before each update


def test_the_policy_moves(report):
    data, _ = report
    for run in data["runs"]:
        kl = [s["kl_from_start"] for s in run["steps"]]  # each after its step's update
        assert 0 < kl[0] < kl[-1], kl


def test_speculative_steps_record_the_served_counters(report):
    data, _ = report
    for run in data["runs"]:
        for s in run["steps"]:
            if run["arm"] == "plain":
                assert s["num_drafts"] == 0 and s["acceptance_length"] is None
            else:
                assert s["num_drafts"] > 0 and len(s["per_position_acceptance"]) == 3
                assert 1.0 <= s["acceptance_length"] <= 4.0


def test_the_online_drafts_publishes_reach_the_engine(report):
    data, _ = report
    for run in data["runs"]:
        versions = [s["draft_version"] for s in run["steps"]]
        if run["arm"] == "online":
            assert versions[-1] > 0 and versions == sorted(versions), versions
            assert run["publish_gate"] == []  # --quick publishes on schedule: no gate verdicts
        elif run["arm"] == "frozen":
            assert set(versions) == {0}


def test_the_reward_curves_are_compared_and_the_logprobs_checked(report):
    data, out = report
    for arm in ("frozen", "online"):
        verdict = data["lossless"]["arms"][arm]
        # per outcome (reward, KL): windows 0-1, 2, 3-4, 5 (restarting at the switch), the final steps
        assert verdict["tested"] and len(verdict["buckets"]) == 2 * 5
        assert all(0.0 <= b["p"] <= 1.0 for b in verdict["buckets"])
    for arm, a in data["arms"].items():
        assert a["logprob_check"]["steps_checked"] == 12  # every step of both seeds had on-policy samples
        assert a["logprob_check"]["max"] < 1e-3  # float32: the trainer's logprobs are vLLM's
    assert "online_switch_recovery" in data["goals"]
    assert (out / "rl_run.png").stat().st_size > 10_000
