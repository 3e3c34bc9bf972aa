"""``demo_report.same_length_ratios``: a run against plain's engine at the very same answer lengths, whole
and split into bulk and tail by the same rule (``rl.rollouts.bulk_and_tail``)."""

from __future__ import annotations

import pytest

from helpers import load_script


def _report_module():
    return load_script("scripts/demo_report.py")


def _step(step, gen, bulk, step_s=20.0):
    return {"step": step, "generation_s": gen, "generation_bulk_s": bulk, "generation_tail_s": gen - bulk,
            "exposed_generation_s": gen, "step_s": step_s}


def test_same_length_ratios_split_bulk_and_tail_of_the_same_answers():
    """Spec's loop: bulk 4 + 3, tail 4 + 5 over two steps; plain's replay of spec's lengths: bulk 5 + 5,
    tail 3 + 3. Bulk 7 / 10, tail 9 / 6, whole 16 / 16."""
    runs = {"spec": {"steps": [_step(0, 8.0, 4.0), _step(1, 8.0, 3.0)]},
            "plain": {"steps": [_step(0, 7.0, 4.0), _step(1, 7.0, 4.0)],
                      "length_replays": {
                          "spec": [{"step": 0, "generation_s": 8.0, "bulk_s": 5.0, "tail_s": 3.0},
                                   {"step": 1, "generation_s": 8.0, "bulk_s": 5.0, "tail_s": 3.0}],
                          "plain": [{"step": 0, "generation_s": 7.0, "bulk_s": 4.0, "tail_s": 3.0},
                                    {"step": 1, "generation_s": 7.0, "bulk_s": 4.0, "tail_s": 3.0}]}}}
    out = _report_module().same_length_ratios(runs, "spec", "plain")
    assert out["rollout_time_same_lengths"] == pytest.approx(1.0)
    assert out["rollout_bulk_time_same_lengths"] == pytest.approx(0.7)
    assert out["rollout_tail_time_same_lengths"] == pytest.approx(1.5)


def test_replays_recorded_before_the_split_give_the_whole_ratio_only():
    runs = {"spec": {"steps": [_step(0, 8.0, 4.0)]},
            "plain": {"steps": [_step(0, 7.0, 4.0)],
                      "length_replays": {"spec": [{"step": 0, "generation_s": 8.0}],
                                         "plain": [{"step": 0, "generation_s": 7.0}]}}}
    out = _report_module().same_length_ratios(runs, "spec", "plain")
    assert out["rollout_time_same_lengths"] == pytest.approx(1.0)
    assert "rollout_bulk_time_same_lengths" not in out


def test_the_verdict_says_whether_it_paid_and_where_it_would_from_the_runs_own_figures():
    """A default demo's JSON (2026-11-29, AMD): the sentence's figures are the calibration's own, k = 3 against
    k = 0 in the largest and the smallest bucket, and the served acceptance length over the steps."""
    import json

    from helpers import REPO

    report = json.loads((REPO / "benchmarks/cpu/rl_demo_first_run_default_avx512.json").read_text())
    buckets = report["runs"]["spec"]["calibration"]["buckets"]
    cost16 = buckets["16-23"]["step_time_vs_served"][3] / buckets["16-23"]["step_time_vs_served"][0]
    cost1 = buckets["1-1"]["step_time_vs_served"][3] / buckets["1-1"]["step_time_vs_served"][0]
    als = [s["acceptance_length"] for s in report["runs"]["spec"]["steps"] if s["acceptance_length"]]
    al = sum(als) / len(als)
    text = _report_module().verdict(report)
    per_token = report["summary"]["comparisons"]["spec_vs_plain"]["rollout_time_per_token"]
    assert f"time per token {per_token:.2f}" in text
    assert f"at 16-23 sequences (this demo's bulk) a k = 3 step costs {cost16:.2f} plain steps" in text
    assert f"at 1 sequence a k = 3 step costs {cost1:.2f} plain steps, so AL {al:.2f} gives ~{al / cost1:.2f}x" in text
    assert cost1 < cost16  # one sequence is where speculation pays on a CPU


def test_no_verdict_without_a_calibration():
    report = {"runs": {"spec": {"steps": [{"acceptance_length": 2.0}]}}, "summary": {"comparisons": {}}}
    assert _report_module().verdict(report) is None
