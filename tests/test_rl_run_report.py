"""The staleness run's report (``scripts/rl_run_report.py``) on synthetic runs: the RL-level lossless test
passes arms drawn like plain and fails a shifted one, the goals read the windows as the issue states
them, and the switch's recovery is counted in steps and trainer seconds. No engine."""

from __future__ import annotations

import random

import pytest

from helpers import load_script


def _report():
    return load_script("scripts/rl_run_report.py")


def _run(arm, seed, rewards, al=None, trainer_s=None, kl=None):
    steps = []
    for i, r in enumerate(rewards):
        steps.append({"step": i, "mean_reward": r, "kl_from_start": 0.01 * i if kl is None else kl[i],
                      "acceptance_length": None if al is None else al[i],
                      "per_position_acceptance": [] if al is None else [(al[i] - 1) / 2],
                      "generation_ms_per_token": 10.0, "mean_completion_tokens": 40.0, "draft_version": 0,
                      "trainer_cpu_s": None if trainer_s is None else trainer_s[i],
                      "on_policy_logprob_abs_diff_max": 0.01, "on_policy_logprob_abs_diff_mean": 0.001})
    return {"arm": arm, "seed": seed, "steps": steps, "host": {"cpu_model": "test"}, "settings": {},
            "publish_gate": [] if arm.startswith("online") else None}


def _curve(seed, shift=0.0, steps=20):
    """A learning curve from 0.3 to 0.8 with per-seed noise (sd 0.05 per step)."""
    rng = random.Random(seed)
    return [min(1.0, 0.3 + 0.5 * i / (steps - 1) + shift + rng.gauss(0, 0.05)) for i in range(steps)]


def test_arms_drawn_like_plain_agree_and_a_shifted_arm_fails():
    runs = [_run("plain", s, _curve(s)) for s in range(3)]
    runs += [_run("frozen", s, _curve(100 + s)) for s in range(3)]
    runs += [_run("lossy", s, _curve(200 + s, shift=0.15)) for s in range(3)]
    report = _report().build_report(runs, window=5)
    verdicts = {a: v["agrees_with_plain"] for a, v in report["lossless"]["arms"].items()}
    assert verdicts == {"frozen": True, "lossy": False}
    assert report["goals"]["rl_lossless"]["met"] is True  # the lossy arm is the plant, not a speculative arm
    assert report["goals"]["rl_lossless"]["planted_lossy_caught"] is True


def _kl(seed, scale=1.0, steps=20):
    """KL from the start rising to 0.2 (times ``scale``) with per-seed noise."""
    rng = random.Random(seed)
    return [max(0.0, scale * 0.2 * i / (steps - 1) + rng.gauss(0, 0.01)) for i in range(steps)]


def test_an_arm_whose_policy_moves_further_fails_on_kl_though_its_reward_agrees():
    runs = [_run("plain", s, _curve(s), kl=_kl(s)) for s in range(3)]
    runs += [_run("frozen", s, _curve(100 + s), kl=_kl(100 + s)) for s in range(3)]
    runs += [_run("lossy", s, _curve(200 + s), kl=_kl(200 + s, scale=4.0)) for s in range(3)]
    lossless = _report().build_report(runs, window=5)["lossless"]["arms"]
    assert lossless["frozen"]["agrees_with_plain"] is True
    assert lossless["lossy"]["agrees_with_plain"] is False
    assert lossless["lossy"]["rejected_on"] == ["kl_from_start"]
    assert {r["outcome"] for r in lossless["lossy"]["buckets"]} == {"mean_reward", "kl_from_start"}


def test_one_seed_is_not_tested():
    report = _report().build_report([_run("plain", 0, _curve(0)), _run("frozen", 0, _curve(1))])
    assert report["lossless"]["arms"]["frozen"]["tested"] is False


def test_holm_rejects_in_order_and_stops_at_the_first_kept():
    assert _report().holm([0.001, 0.04, 0.03, 0.5]) == [True, False, False, False]
    assert _report().holm([0.001, 0.02, 0.012]) == [True, True, True]


def test_goals_when_the_frozen_draft_goes_stale_and_the_online_one_holds():
    steps = 20
    frozen_al = [2.0 - 0.4 * i / (steps - 1) for i in range(steps)]  # falls 0.4
    online_al = [2.0] * steps
    runs = [_run("frozen", 0, _curve(0), frozen_al), _run("online", 0, _curve(1), online_al)]
    goals = _report().build_report(runs, window=5)["goals"]
    assert goals["frozen_fall"]["stale"] and goals["online_holds"]["met"] and goals["online_beats_frozen"]["met"]
    runs.append(_run("online-keep4", 0, _curve(2), [a + 0.05 for a in frozen_al]))  # a trainer variant, judged apart
    goals = _report().build_report(runs, window=5)["goals"]
    assert goals["online_holds"]["met"] and not goals["online-keep4_holds"]["met"]
    runs.pop()
    runs[1] = _run("online", 0, _curve(1), [a + 0.05 for a in frozen_al])  # online follows frozen down
    goals = _report().build_report(runs, window=5)["goals"]
    assert goals["frozen_fall"]["stale"] and not goals["online_holds"]["met"]
    assert not goals["online_beats_frozen"]["met"]


def test_no_staleness_means_nothing_to_recover():
    runs = [_run("frozen", 0, _curve(0), [2.0] * 20), _run("online", 0, _curve(1), [2.0] * 20)]
    goals = _report().build_report(runs, window=5)["goals"]
    assert goals["frozen_fall"]["stale"] is False and goals["online_beats_frozen"]["met"] is None


def test_recovery_after_a_switch_counts_steps_and_trainer_seconds():
    al = [2.0] * 10 + [1.5, 1.6, 1.8, 1.95, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    trainer_s = [10.0 * i for i in range(20)]
    runs = [_run("frozen", 0, _curve(0), [2.0] * 10 + [1.5] * 10),
            _run("online", 0, _curve(1), al, trainer_s)]
    report = _report().build_report(runs, window=3, switch_at=10)
    rec = report["arms"]["online"]["recovery"]
    # windows of 3 from step 10: 1.63, 1.78, 1.92, 1.98 (>= 2.0 - 0.05): three steps
    assert rec["recovered_after_steps"] == 3 and rec["trainer_cpu_s"] == pytest.approx(30.0)
    assert report["goals"]["online_switch_recovery"]["met"] is True
    assert report["arms"]["frozen"]["recovery"]["post_switch_window"] == pytest.approx(1.5)


def test_the_plot_is_written(tmp_path):
    runs = [_run("plain", 0, _curve(0)), _run("frozen", 0, _curve(1), [2.0] * 20)]
    report = _report().build_report(runs, window=5, switch_at=10)
    _report().plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_a_finished_run_is_resumed_only_with_the_settings_that_matter_to_its_arm():
    """The online trainer's options matter to online arms alone; an option a recorded run predates counts at
    its default (so adding one does not throw away finished runs)."""
    rl_run = load_script("scripts/rl_run.py")
    recorded = {"task": "concise", "steps": 30, "draft_lr": 2e-4, "draft_publish_every": 4, "draft_holdout_every": 4,
                "draft_replay_ratio": 4.0, "draft_tv_weight": 0.0, "block_publishes": False}
    wanted = {**recorded, "draft_keep_versions": 1, "draft_rest_after_hold": True, "draft_rest_backoff_max": 8}
    assert rl_run.same_settings(recorded, wanted, "online")
    assert not rl_run.same_settings(recorded, {**wanted, "draft_keep_versions": 4}, "online")
    assert rl_run.same_settings(recorded, {**wanted, "draft_keep_versions": 4}, "frozen")
    assert not rl_run.same_settings(recorded, {**wanted, "steps": 20}, "frozen")


def test_windows_restart_at_the_switch():
    bounds = _report().window_bounds(30, 5, switch_at=18)
    assert bounds == [(0, 5), (5, 10), (10, 15), (15, 18), (18, 23), (23, 28), (28, 30)]
    assert _report().window_bounds(10, 5) == [(0, 5), (5, 10)]


def test_the_final_evaluation_compares_the_drafts_on_each_runs_own_final_policy():
    runs = [_run("online", s, _curve(s), [2.0] * 20) for s in range(2)]
    for run, (ended, starting) in zip(runs, [(2.4, 1.9), (2.2, 2.1)]):
        run["final_drafts_eval"] = {"ended_with": {"acceptance_length": ended, "num_drafts": 300},
                                    "starting": {"acceptance_length": starting, "num_drafts": 320}}
    got = _report().build_report(runs)["arms"]["online"]["final_drafts_eval"]
    assert got["ended_with"] == pytest.approx(2.3) and got["starting"] == pytest.approx(2.0)
    assert got["gain"] == pytest.approx(0.3)
    del runs[1]["final_drafts_eval"]  # a run recorded before the evaluation existed counts for nothing
    assert _report().build_report(runs)["arms"]["online"]["final_drafts_eval"]["gain"] == pytest.approx(0.5)
    del runs[0]["final_drafts_eval"]
    assert _report().build_report(runs)["arms"]["online"]["final_drafts_eval"] is None
