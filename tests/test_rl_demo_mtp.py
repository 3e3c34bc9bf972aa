"""``scripts/rl_demo.py --runs mtp,plain`` on the tiny-mimo fixture: the RL loop with the policy's own MTP
layer as the drafter, kept aligned online.

Two writers share the engine: the loop's policy updates carry the body alone (``keep_mtp``) and
``train-draft --mtp`` publishes the MTP layer as a draft update. Checked: every step's update
lands (a refused body-only update, or one that waited forever on the trainer's, fails the run),
the trainer's publish was committed, rollouts stay on-policy with logprobs equal to the trainer's
recomputation (float32), and the plain run on the same MiMo checkpoint takes body-only updates too.

Engines: `scripts/rl_demo.py --runs mtp,plain` end to end, two runs each with a server and a trainer
(slow tier).
"""

from __future__ import annotations

import json

import pytest

from helpers import run_rl_demo

pytestmark = [pytest.mark.server, pytest.mark.slow]
STEPS, PROMPTS, GROUP = 3, 2, 4


@pytest.fixture(scope="module")
def report(mimo_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_demo_mtp") / "rl_demo.json"
    # The trainer publishes after its first step, is not niced and does not yield the policy phases to
    # the loop: a slow machine still sees a publish. (Yielding, it trains only while rollouts run: with
    # 8-token answers on the tiny model that is a few tenths of a second per step, which a CI machine's
    # trainer, polling its pause file between 200-ms capture reads, missed in all 3 steps.)
    # Unconditionally (no publish gate): this checks the two writers' mechanics, and the fixture's MTP
    # layer is already aligned, so a gated trainer rightly keeps it (tests/trainer/test_publish_gate.py).
    data, stdout = run_rl_demo(mimo_model, "mtp,plain", out, STEPS, PROMPTS, GROUP,
                               "--draft-publish-every", "1", "--draft-nice", "0", "--draft-holdout-every", "0",
                               "--no-draft-trainer-yields")
    work = out.parent / "rl_demo_work"
    trainer_log = [json.loads(line) for line in (work / "online_draft_mtp.jsonl").read_text().splitlines() if line]
    return data, stdout, trainer_log


def test_policy_updates_land_on_both_engines_and_rollouts_stay_on_policy(report):
    data, _, _ = report
    for mode in ("mtp", "plain"):
        steps = data["runs"][mode]["steps"]
        assert [s["policy_version"] for s in steps] == list(range(STEPS)), steps
        for s in steps:
            assert s["rollout_policy_versions"] == [[s["step"], s["step"]]], s
            assert s["on_policy_logprob_abs_diff_max"] < 1e-3, s


def test_the_online_trainer_publishes_the_mtp_layer_beside_the_policy_updates(report):
    data, stdout, trainer_log = report
    published = [r["publish"] for r in trainer_log if r.get("publish")]
    assert published and all("error" not in p for p in published), published
    assert any(p.get("version", 0) >= 1 for p in published), published
    steps = data["runs"]["mtp"]["steps"]
    # The MTP layer drafted on every step adaptive k let it draft on (k = 0 for a whole step is the timing
    # calibration's call on a loaded machine, not the drafter's), and a published layer's drafts were accepted.
    assert all(s["acceptance_length"] for s in steps if s["mean_k"] > 0), steps
    assert any((s["acceptance_length"] or 0) > 1 for s in steps if s["draft_version"] >= 1), steps
    assert "mtp_vs_plain" in data["summary"]["comparisons"] and "mtp_vs_plain" in stdout


def test_the_runs_took_their_steps_in_turn_the_first_rotating(report):
    """Two synchronous runs are interleaved by default (``--interleave-runs``): both processes alive,
    one run's step timed while the other waits, mtp first on even steps and plain first on odd ones
    (by wall clock: each step starts after the step before it in that order ended)."""
    data, _, _ = report
    assert data["interleaved_runs"] is True
    by_mode = {m: {s["step"]: s for s in data["runs"][m]["steps"]} for m in ("mtp", "plain")}
    order = []
    for step in range(STEPS):
        first, second = ("mtp", "plain") if step % 2 == 0 else ("plain", "mtp")
        order += [by_mode[first][step], by_mode[second][step]]
    for before, after in zip(order, order[1:]):
        assert before["ended_at"] <= after["started_at"], (before["step"], after["step"])
    assert len({r["pid"] for r in data["runs"].values()} | {data["pid"]}) == 3
