"""The step-cost fit behind the history proposer's per-batch threshold: it recovers a known cost
from noisy steps with host stalls, and the threshold it gives is the break-even acceptance
(checked against a direct count of tokens per second, not against its own formula)."""

import numpy as np
import pytest

from vllm_specrl.proposer.step_cost import MAX_THRESHOLD, MIN_THRESHOLD, StepCostFit, StepCostModel

FIXED_S, PER_ROW_S, SPEC_PATH_S = 0.040, 0.009, 0.004   # rows dearer than the AVX2 VM's 3-5 ms: thresholds spread


def synthetic_steps(n: int, seed: int = 0):
    """Steps as a rollout makes them: the batch shrinks as answers end, drafts come and go, the
    time is the cost model plus 8% noise, and one step in 25 waits 0.3 s for the host."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        batch = max(1, 16 - i * 16 // n)
        drafted = int(rng.binomial(batch, 0.3)) * int(rng.integers(1, 4))
        seconds = (FIXED_S + PER_ROW_S * (batch + drafted) + SPEC_PATH_S * (drafted > 0)) * rng.normal(1.0, 0.08)
        if i % 25 == 7:
            seconds += 0.3
        yield batch, batch + drafted, drafted > 0, seconds


def test_the_fit_recovers_a_known_step_cost_through_noise_and_stalls():
    model = StepCostModel()
    for step in synthetic_steps(600):
        model.observe(*step)
    fit = model.fit
    assert fit is not None
    assert fit.per_row_s == pytest.approx(PER_ROW_S, rel=0.08)
    assert fit.fixed_s == pytest.approx(FIXED_S, rel=0.12)
    assert fit.spec_path_s == pytest.approx(SPEC_PATH_S, abs=0.004)
    status = model.status()
    assert status["fitted"] and status["by_batch"][1]["threshold"] < status["by_batch"][16]["threshold"]


def test_the_threshold_is_where_a_drafted_token_stops_paying():
    """Tokens per second at b sequences, every sequence drafting one token accepted with chance pi:
    (b + b pi) / (F + R 2b) against b / (F + R b). Just above the threshold drafting is faster, just
    below it is slower."""
    fit = StepCostFit(fixed_s=FIXED_S, per_row_s=PER_ROW_S, spec_path_s=0.0, steps=100)
    for batch in (1, 4, 16):
        pi = fit.threshold(batch)
        plain = batch / (FIXED_S + PER_ROW_S * batch)

        def drafting(p):
            return batch * (1 + p) / (FIXED_S + PER_ROW_S * 2 * batch)

        assert drafting(pi + 0.02) > plain > drafting(pi - 0.02)
    assert fit.threshold(1) < 0.25 < fit.threshold(4) < fit.threshold(16)


def test_free_rows_draft_anything_and_costly_rows_nothing():
    assert StepCostFit(0.02, 0.0, 0.0, 100).threshold(8) == MIN_THRESHOLD   # a memory-bound GPU step
    assert StepCostFit(-0.01, 0.01, 0.0, 100).threshold(1) == MAX_THRESHOLD  # a fit that makes no sense


def test_no_threshold_until_the_fit_has_enough_varied_steps():
    model = StepCostModel(min_steps=32)
    for _ in range(200):
        model.observe(16, 16, False, 0.18)   # one row count only: R cannot be told from F
    assert model.fit is None and model.threshold(16) is None
    for step in synthetic_steps(31):
        model.observe(*step)
    assert model.threshold(4) is not None


def test_each_batch_size_is_judged_by_the_cost_of_its_own_rows():
    """A step whose row costs 3 ms at one or two sequences (memory-bound) and 9 ms at eight and more
    (compute-bound). The threshold at one sequence comes from the steps at one or two (0.07), the one
    at sixteen from those at eight to thirty-two (0.78); one line over all of them gets both wrong."""
    rng = np.random.default_rng(1)
    model = StepCostModel()
    for i in range(500):
        batch = [1, 2, 4, 8, 12, 16][i % 6]
        rows = batch + int(rng.integers(0, 2 * batch + 1))
        per_row = 0.003 if batch <= 2 else 0.009 if batch >= 8 else 0.006
        model.observe(batch, rows, rows > batch, (FIXED_S + per_row * rows) * rng.normal(1.0, 0.03))
    assert model.threshold(1) == pytest.approx(0.003 / (FIXED_S + 0.003), abs=0.02)
    assert model.threshold(16) == pytest.approx(0.144 / (FIXED_S + 0.144), abs=0.03)
    assert abs(model.fit.threshold(1) - model.threshold(1)) > 0.04   # the one line


def test_a_local_line_that_makes_no_sense_gives_way_to_the_line_over_all_steps():
    """A few tail steps at one and two sequences, timed while the host stalled more the fewer rows
    they had: their own line says a row costs less than nothing. The threshold there is the one of
    the line over all steps, not the floor."""
    rng = np.random.default_rng(2)
    model = StepCostModel()
    for i in range(400):
        batch = [4, 8, 16][i % 3]
        rows = batch + int(rng.integers(0, batch + 1))
        model.observe(batch, rows, rows > batch, (FIXED_S + PER_ROW_S * rows) * rng.normal(1.0, 0.03))
    for i in range(40):
        rows = 1 + i % 4
        model.observe(1 + i % 2, rows, rows > 2, 0.100 - 0.010 * rows)
    assert model.threshold(1) == pytest.approx(model.fit.threshold(1), abs=1e-9)
    assert model.threshold(1) == pytest.approx(PER_ROW_S / (FIXED_S + PER_ROW_S), abs=0.03)
