"""The step-time model reproduces the paper's anchor and behaves at its limits."""

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_specrl.projection import StageTimes, project, rollout_speedup, step_cost

REPO = Path(__file__).resolve().parents[1]


def test_paper_anchor_rollout_1_77x_at_65_to_72_percent_gives_about_1_4x():
    lo = project(StageTimes.from_share(0.65), 1.77)["sync_step_speedup"]
    hi = project(StageTimes.from_share(0.72), 1.77)["sync_step_speedup"]
    assert lo == pytest.approx(1 / (0.65 / 1.77 + 0.35))
    assert 1.35 < lo < hi < 1.5


def test_speedup_from_acceptance_and_cost():
    assert step_cost(3, 0.1, 0.2) == pytest.approx(1.5)
    assert rollout_speedup(3.0, 1.5) == pytest.approx(2.0)


def test_async_gains_stop_when_training_dominates():
    t = StageTimes(rollout_s=1.0, other_s=1.0)
    assert project(t, 2.0)["async_spec_vs_async_plain"] == pytest.approx(1.0)
    t = StageTimes(rollout_s=3.0, other_s=2.0)  # training becomes the longer stream at s=1.5
    assert project(t, 2.0)["async_spec_vs_async_plain"] == pytest.approx(1.5)
    assert project(t, 100.0)["sync_step_speedup"] < project(t, 100.0)["rollout_bound_limit"]


def test_cli_checks_the_paper():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "project_speedup.py"), "--check-paper"],
                         capture_output=True, text=True, check=True).stdout
    assert "projected step speedup 1.39x-1.46x" in out


def test_cli_checks_a_demo_report(tmp_path):
    """Projected vs measured from an rl_demo report: when only rollouts change, the two agree."""
    import json

    def steps(gen, other):
        return [{"generation_s": gen, "training_s": other, "logprob_s": 0.0, "sync_s": 0.0, "step_s": gen + other}
                for _ in range(3)]

    report = {"runs": {"plain": {"steps": steps(6.0, 4.0)}, "spec": {"steps": steps(3.0, 4.0)}}}
    path = tmp_path / "rl_demo.json"
    path.write_text(json.dumps(report))
    out_json = tmp_path / "check.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "project_speedup.py"), "--check-demo", str(path),
                    "--out", str(out_json)], capture_output=True, text=True, check=True)
    check = json.loads(out_json.read_text())
    assert check["measured_rollout_speedup"] == pytest.approx(2.0)
    assert check["projected_step_speedup"] == pytest.approx(10 / 7)
    assert check["measured_step_speedup"] == pytest.approx(10 / 7)
    assert check["measured_other_stages_ratio"] == pytest.approx(1.0)
