"""``scripts/rl_demo.py`` end to end on the tiny fixture: a speculative async run (EAGLE-3), a run with the
rollout-history proposer and a plain sync run, over a dataset of PROMPTS tasks (the same prompts every step).

Checks what the demo promises rather than its numbers: every rollout exactly
once per step with the policy versions it was sampled under, async rollouts at
most one version behind, on-policy logprobs recomputed by the trainer equal
vLLM's (float32), k chosen per step, and the JSON/PNG/table.

Engines: `scripts/rl_demo.py` end to end, three runs each with a server and a trainer (slow tier).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import WARM_DRAFT_VOCAB
from helpers import run_rl_demo

pytestmark = [pytest.mark.server, pytest.mark.slow]
STEPS, PROMPTS, GROUP = 3, 2, 4
WARM_UP = 1  # one untimed step per run first, as make demo takes
# A fixed draft threshold for the history run: with the default cost fit, whether a tiny-fixture step found any
# draft worth a row hung on that run's step timings (a run saw no step draft).
HISTORY_CONFIG = {"cost_aware": False, "min_confidence": 0.1}


@pytest.fixture(scope="module")
def report(tiny_model, warm_draft, tmp_path_factory):
    # The warm draft, not a fresh one: a fresh draft accepts nothing here, so adaptive k rightly serves k = 0
    # and whether a timed step drafts at all was up to its exploration (a suite run saw none of 3 draft).
    out = tmp_path_factory.mktemp("rl_demo") / "rl_demo.json"
    return run_rl_demo(tiny_model, "spec-async,history,plain", out, STEPS, PROMPTS, GROUP,
                       "--draft", str(warm_draft), "--draft-vocab-size", str(WARM_DRAFT_VOCAB),
                       "--draft-lr", "3e-4", "--draft-tv-weight", "0.5",
                       "--history-config", json.dumps(HISTORY_CONFIG), warm_up_steps=WARM_UP)


def test_the_online_trainer_trains_with_the_demos_draft_options(report):
    """``--draft-lr`` and ``--draft-tv-weight`` reach the online trainer: its checkpoint's config says so."""
    data, _ = report
    out = Path(data["settings"]["out"])
    meta = json.loads((out.parent / f"{out.stem}_work" / "draft-online-spec-async" / "trainer_meta.json").read_text())
    assert (meta["config"]["lr"], meta["config"]["tv_weight"]) == (3e-4, 0.5)


def test_every_rollout_once_with_its_versions(report):
    data, _ = report
    for mode, run in data["runs"].items():
        assert [s["step"] for s in run["warm_up_steps"]] == list(range(-WARM_UP, 0))
        assert [s["step"] for s in run["steps"]] == list(range(STEPS))
        for s in run["warm_up_steps"] + run["steps"]:
            assert s["rollouts"] == PROMPTS * GROUP
            assert s["rollout_policy_versions"], s
            # the engine served version `step` (counted from the first warm-up step) when it was sampled
            assert s["policy_version"] == s["step"] + WARM_UP


def test_async_rollouts_lag_at_most_one_version(report):
    data, _ = report
    for s in data["runs"]["spec-async"]["steps"]:
        version = s["step"] + WARM_UP
        for start, end in s["rollout_policy_versions"]:
            assert version - 1 <= start <= end <= version, s
        assert s["exposed_generation_s"] <= s["generation_s"] + 0.5


@pytest.mark.parametrize("mode", ["plain", "history"])
def test_sync_rollouts_are_on_policy_and_logprobs_match(report, mode):
    """The sampled tokens' logprobs vLLM reported equal the trainer's recomputation, also where a
    speculative step emitted them (the history run's accepted drafts, its recovered and bonus tokens)."""
    data, _ = report
    for s in data["runs"][mode]["steps"]:
        assert s["rollout_policy_versions"] == [[s["step"] + WARM_UP] * 2]
        assert s["rollouts_from_trained_version"] == PROMPTS * GROUP
        assert s["on_policy_logprob_abs_diff_max"] < 1e-3, s


def test_speculative_run_chose_k_per_step(report):
    data, _ = report
    steps = data["runs"]["spec-async"]["steps"]
    assert all(s["mean_k"] is not None for s in steps), steps  # adaptive k reported every step
    assert any(s["acceptance_length"] for s in steps), "nothing was drafted"
    for s in steps:  # the first draft's acceptance is a share of all accepted draft tokens
        if s["acceptance_length"] is not None:
            assert 0.0 <= s["accept_pos0"] <= s["acceptance_length"] - 1.0 + 1e-9, s
    for s in data["runs"]["plain"]["steps"]:
        assert s["mean_k"] is None and s["acceptance_length"] is None and s["accept_pos0"] is None
        assert s["generation_bulk_s"] + s["generation_tail_s"] == pytest.approx(s["generation_s"])


def test_history_run_serves_with_drafts(report):
    """Every step samples the same prompts, so the history proposer has the earlier steps' rollouts
    (older policy versions, aged but kept) besides its own group to draft from; vLLM's counters show
    drafts verified (the tiny fixture at T=1 accepts few). No adaptive k there: the proposer sets each
    request's draft length, here from ``--history-config``'s fixed threshold."""
    data, stdout = report
    out = Path(data["settings"]["out"])
    served_with = (out.parent / f"{out.stem}_work" / "serve_history.log").read_text()  # vLLM logs its non-default args
    assert f"'history': {HISTORY_CONFIG}" in served_with
    steps = data["runs"]["history"]["steps"]
    assert all(s["mean_k"] is None for s in steps), steps
    assert any(s["acceptance_length"] is not None for s in steps), steps
    assert "history_vs_plain" in data["summary"]["comparisons"] and "history" in stdout


def test_summary_table_and_plot(report):
    data, stdout = report
    comparison = data["summary"]["comparisons"]["spec-async_vs_plain"]  # async + spec stacked vs plain sync
    # Recomputed from the per-step records: the summary must say what the steps measured.
    mean = {mode: sum(s["step_s"] for s in data["runs"][mode]["steps"]) / STEPS for mode in ("spec-async", "plain")}
    assert comparison["step_time"] == pytest.approx(mean["spec-async"] / mean["plain"], rel=1e-9)
    per_token = {mode: sum(s["generation_s"] for s in data["runs"][mode]["steps"])
                 / sum(s["tokens"] for s in data["runs"][mode]["steps"]) for mode in mean}
    assert comparison["rollout_time_per_token"] == pytest.approx(per_token["spec-async"] / per_token["plain"],
                                                                 rel=1e-9)
    rewards = {mode: [x for s in data["runs"][mode]["steps"] for x in s["rewards"]] for mode in mean}
    assert all(len(r) == STEPS * PROMPTS * GROUP and set(r) <= {0.0, 1.0} for r in rewards.values())
    diff = sum(rewards["spec-async"]) / len(rewards["spec-async"]) - sum(rewards["plain"]) / len(rewards["plain"])
    assert comparison["reward_difference"] == pytest.approx(diff, abs=1e-12)
    assert comparison["rewards_agree_within_noise"] == (abs(comparison["reward_z"]) < 3)
    assert f"{comparison['step_time']:.2f}" in stdout and data["plot"].endswith(".png")


def test_runs_start_calibrated_or_warmed_up_alike(report):
    """Before step 0 the speculative run's adaptive k measured every k at each batch size the steps
    run at (8, 7, 5, 3, 2,
            1 here: each bucket's largest), the plain run got the same requests as a warm-up, and each run ran in
    a process of its own with its own trainer warm-up, so no run pays a start-up cost in its timed
    steps and none reuses a heap that a run before it grew."""
    data, _ = report
    spec = data["runs"]["spec-async"]["calibration"]
    assert spec["adaptive_k"] and [b["batch"] for b in spec["batches"]] == [8, 7, 5, 3, 2, 1], spec
    assert all(b["swept"] for b in spec["batches"]), spec
    plain = data["runs"]["plain"]["calibration"]
    assert not plain["adaptive_k"] and [b["batch"] for b in plain["batches"]] == [8, 7, 5, 3, 2, 1], plain
    runs = data["runs"].values()
    assert all(r["trainer_warm_up_s"] > 0 for r in runs)
    assert len({r["pid"] for r in runs} | {data["pid"]}) == len(data["runs"]) + 1


def test_plain_run_replays_every_run_at_its_exact_lengths(report):
    """After its steps the plain engine generated each timed step's rollouts of the runs before it, and
    its own, again at exactly the lengths each sampled, and the summary's same-lengths ratios are those
    replays' times. (The tiny fixture's answers run to the cap; that a replay ignores EOS is checked in
    tests/rl/test_rollouts.py.)"""
    data, stdout = report
    replays = data["runs"]["plain"]["length_replays"]
    assert list(replays) == ["spec-async", "history", "plain"]
    for mode, recs in replays.items():
        assert [r["step"] for r in recs] == list(range(STEPS))
        for r in recs:
            ref = next(s for s in data["runs"][mode]["steps"] if s["step"] == r["step"])
            assert sorted(n for row in ref["completion_lengths"] for n in row) == ref["completion_tokens"]
            assert r["completion_lengths"] == ref["completion_lengths"], (mode, r["step"])
    for mode in ("spec-async", "history"):
        c = data["summary"]["comparisons"][f"{mode}_vs_plain"]
        gen = sum(s["generation_s"] for s in data["runs"][mode]["steps"])
        assert c["rollout_time_same_lengths"] == pytest.approx(gen / sum(r["generation_s"] for r in replays[mode]))
        own = sum(s["generation_s"] for s in data["runs"]["plain"]["steps"])
        assert c["base_replay_over_its_loop"] == pytest.approx(sum(r["generation_s"] for r in replays["plain"]) / own)
        assert f"against plain at the same lengths {c['rollout_time_same_lengths']:.2f}" in stdout
        # Spec's loop over plain's loop estimated at spec's lengths: plain's replay at them, scaled up
        # by how much less than its loop plain's replay of its own lengths took.
        plain_loop_estimate = sum(r["generation_s"] for r in replays[mode]) / c["base_replay_over_its_loop"]
        assert c["rollout_time_same_lengths_loop_adjusted"] == pytest.approx(gen / plain_loop_estimate)
        assert f"adjusted for that {c['rollout_time_same_lengths_loop_adjusted']:.2f}" in stdout
    # The synchronous history run: its steps with plain's generation at its lengths in place of its own.
    c = data["summary"]["comparisons"]["history_vs_plain"]
    steps = data["runs"]["history"]["steps"]
    step_s = sum(s["step_s"] for s in steps)
    plain_gen = sum(r["generation_s"] for r in replays["history"])
    assert c["step_time_same_lengths"] == pytest.approx(
        step_s / (step_s - sum(s["exposed_generation_s"] for s in steps) + plain_gen))
    assert "step_time_same_lengths" not in data["summary"]["comparisons"]["spec-async_vs_plain"]
