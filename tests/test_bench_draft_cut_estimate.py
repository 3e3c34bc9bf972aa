"""``scripts/bench/bench_draft_cut_estimate.py``: uncut, its walk must count what the trainer's served
estimate counts; a cut must drop exactly the steps the rule refuses on the gain side and count only the
sampled rows it keeps on the cost side; the step-cost line must reproduce the measured steps it is
fitted to; the oracle feature must estimate what the emitted tokens' weights estimate.

Engines: none; one test runs HF forwards of the tiny target and the session's warm draft (features,
the trainer's unroll) in this process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import load_script
from vllm_specrl.trainer.acceptance import StepAcceptance, served_acceptance


def _bench():
    return load_script("scripts/bench/bench_draft_cut_estimate.py")


def _features(seed: int, k: int = 3, n: int = 40, first: int = 7, samples: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    valid = np.zeros((k, n), dtype=bool)
    valid[:, first:n - 2] = True
    valid[1:, n - 4:] = False
    return {"valid": valid, "weight": rng.random((k, n)), "conf": rng.random((k, n)),
            "sampled": rng.random((k, n, samples))}


def _walk(f, rule, level, k_loop, first=7):
    bench = _bench()
    return bench.walk(f["valid"].shape[1], first, f["valid"].shape[0], bench.cut_source(f, rule, level, k_loop))


@pytest.mark.parametrize("seed", [0, 1])
def test_uncut_the_walk_counts_what_the_served_estimate_counts(seed):
    f = _features(seed)
    got = _walk(f, None, 0.0, 3)
    want = served_acceptance(StepAcceptance([torch.from_numpy(v[None]) for v in f["valid"]],
                                            [torch.from_numpy(w[None]).float() for w in f["weight"]]),
                             torch.tensor([7]))
    assert got["accepted"].tolist() == pytest.approx(want["accepted_per_pos"], rel=1e-5)
    # Uncut, each draft start verifies its valid steps.
    assert got["rows"] == pytest.approx(got["drafts"] * 3, rel=0.05)


def test_a_rule_that_holds_everywhere_changes_nothing_and_one_that_never_holds_drafts_nothing():
    f = _features(2)
    uncut = _walk(f, None, 0.0, 3)
    for rule in ("tau", "theta"):
        kept = _walk(f, rule, 0.0, 3)
        assert kept["tokens"] == pytest.approx(uncut["tokens"]) and kept["rows"] == pytest.approx(uncut["rows"])
        none = _walk(f, rule, 1.5, 3)
        assert none["drafts"] == 0.0 and none["rows"] == 0.0 and none["tokens"] == none["steps"]
        assert none["draft_steps"] == pytest.approx(none["steps"])   # the loop still drafts one token to see it


def test_the_cut_drops_exactly_the_refused_steps():
    bench = _bench()
    conf = np.array([[0.9, 0.2], [0.05, 0.9], [0.9, 0.9]])
    assert bench.holds(conf, "tau", 0.1).tolist() == [[True, True], [False, True], [False, True]]
    assert bench.holds(conf, "theta", 0.1).tolist() == [[True, True], [False, True], [False, True]]
    assert bench.holds(conf, "theta", 0.2).tolist() == [[True, True], [False, False], [False, False]]
    f = _features(3)
    f["weight"][:] = 1.0
    f["conf"][:] = 0.9
    f["conf"][1, :] = 0.05        # every second step refused: each draft accepts its first token only
    f["sampled"][:] = 0.9
    f["sampled"][1, :, :4] = 0.05  # half the sampled second tokens refused, and the third after them
    got = _walk(f, "tau", 0.1, 3)
    assert got["accepted"][1] == 0.0 and got["accepted"][0] == pytest.approx(got["drafts"])
    assert got["rows"] == pytest.approx(got["drafts"] * 2.0, rel=0.05)   # 1 + (1 + 1) / 2


def test_the_step_cost_line_reproduces_the_steps_it_is_fitted_to(tmp_path):
    bench = _bench()
    a, r, b, plain = 20.0, 0.25, 16, 28.0
    propose = {1: 2.0, 2: 3.5, 3: 5.0}
    rows = [{"name": "plain#0", "batch_size": b, "ms_per_step": {"step": plain, "propose": 0.0}}]
    rows += [{"name": f"eagle3_k{k}_fast#0", "batch_size": b,
              "ms_per_step": {"step": propose[k] + a + r * b * (1 + k), "propose": propose[k]}} for k in propose]
    path = tmp_path / "step_cost.json"
    path.write_text(json.dumps({"rows": rows}))
    cost = bench.step_cost_model(path)[b]
    assert cost["verify_a_ms"] == pytest.approx(a) and cost["verify_ms_per_row"] == pytest.approx(r)
    # k = 2 drafting everywhere, 1.8 tokens a step: the measured k = 2 step over 1.8 b tokens against plain.
    policy = {"rows_per_step": 2.0, "tokens_per_step": 1.8, "draft_steps_per_step": 2.0}
    want = (propose[2] + a + r * b * 3) / (1.8 * b) / (plain / b)
    assert bench.projected_ratio(cost, b, policy, 2, loop_stops_at_cut=False) == pytest.approx(want)
    # A loop stopping at the cut after 1.5 draft steps on average pays drafting between k = 1 and 2.
    half = bench.projected_ratio(cost, b, dict(policy, draft_steps_per_step=1.5), 2, loop_stops_at_cut=True)
    assert half == pytest.approx((2.75 + a + r * b * 3) / (1.8 * b) / (plain / b))


def test_a_rule_on_a_deterministic_feature_cuts_gain_and_cost_alike():
    f = _features(4)
    f["top"] = np.full_like(f["conf"], 0.9)
    f["top"][2, :] = 0.1          # every third step refused: two rows a draft, no third accepted
    bench = _bench()
    got = bench.walk(f["valid"].shape[1], 7, 3, bench.cut_source(f, "tau", 0.5, 3, feature="top"))
    assert got["accepted"][2] == 0.0 and got["accepted"][1] > 0.0
    assert got["rows"] == pytest.approx(2.0 * got["drafts"], rel=0.05)


def test_the_oracle_feature_is_the_expected_acceptance_of_each_step(tiny_model, warm_draft):
    """``alpha`` (sum min(p, q) from the target's own rows) and the emitted tokens' acceptance weights
    (``min(1, q / p)`` of the token the rollout emitted, from the trainer's unroll) estimate the same
    acceptance per step: over a few thousand draft starts their means agree. A row read one position
    off (the target's distribution of the token after, or before) breaks the agreement."""
    bench = _bench()
    sequences, prompt_lengths = bench.held_out_rollouts(warm_draft, None, 64)
    feats, _ = bench.draft_features(tiny_model, warm_draft, sequences, prompt_lengths, 3, samples=2)
    for j in range(3):
        w = np.concatenate([f["weight"][j][f["valid"][j]] for f in feats])
        a = np.concatenate([f["alpha"][j][f["valid"][j]] for f in feats])
        assert len(w) > 300
        assert abs(w.mean() - a.mean()) < 0.04, (j, w.mean(), a.mean())
        assert a.mean() > 0.3, "the premise: a draft that is accepted"
