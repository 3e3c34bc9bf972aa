"""The step-time model against independent references: simulations of the RL loop and of
speculative decoding itself, and the paper's published anchor.

Engines: two runs of the projection CLI: what a user types.
"""

import random
import subprocess
import sys
from pathlib import Path

import pytest

from projection import StageTimes, acceptance_needed, project, rollout_speedup, step_cost  # scripts/bench

REPO = Path(__file__).resolve().parents[1]


def simulate_sync(t: StageTimes, s: float, steps: int = 50) -> float:
    """Seconds per step of a loop that generates, then trains, then syncs, one after another."""
    clock = 0.0
    for _ in range(steps):
        clock += t.rollout_s / s      # generate with the current policy
        clock += t.other_s            # logprobs + training
        clock += t.draft_overhead_s   # draft sync / exposed draft training
    return clock / steps


def simulate_async_lag1(t: StageTimes, s: float, steps: int = 400) -> float:
    """Steady-state seconds per step with one generator and one trainer as two event streams:
    rollout n needs the policy trained through step n-2 (lag 1), training n needs rollout n."""
    gen_end, train_end = [], []
    for n in range(steps):
        ready = max(gen_end[n - 1] if n else 0.0, train_end[n - 2] if n >= 2 else 0.0)
        gen_end.append(ready + t.rollout_s / s)
        train_end.append(max(gen_end[n], train_end[n - 1] if n else 0.0) + t.other_s)
    half = steps // 2
    return (train_end[-1] - train_end[half]) / (steps - 1 - half)


@pytest.mark.parametrize("rollout_s,other_s,overhead_s,s", [
    (0.68, 0.32, 0.0, 1.77), (0.68, 0.32, 0.05, 1.77), (3.0, 2.0, 0.0, 1.2), (1.0, 4.0, 0.3, 2.5)])
def test_sync_speedup_equals_a_simulated_loop(rollout_s, other_s, overhead_s, s):
    t = StageTimes(rollout_s, other_s, overhead_s)
    plain = simulate_sync(StageTimes(rollout_s, other_s), 1.0)
    assert project(t, s)["sync_step_speedup"] == pytest.approx(plain / simulate_sync(t, s), rel=1e-9)
    assert project(t, s)["rollout_bound_limit"] == pytest.approx(plain / simulate_sync(t, 1e12), rel=1e-6)


@pytest.mark.parametrize("rollout_s,other_s,s", [
    (0.68, 0.32, 1.77), (3.0, 2.0, 2.0), (3.0, 2.0, 1.2), (1.0, 1.0, 2.0), (1.0, 4.0, 1.5)])
def test_async_figures_equal_a_simulated_two_stream_pipeline(rollout_s, other_s, s):
    """Where the generator is the longer stream speculation pays; once training is, it does not."""
    t = StageTimes(rollout_s, other_s)
    p = project(t, s)
    sim_plain_async = simulate_async_lag1(t, 1.0)
    sim_spec_async = simulate_async_lag1(t, s)
    sim_plain_sync = simulate_sync(t, 1.0)
    assert p["async_spec_vs_async_plain"] == pytest.approx(sim_plain_async / sim_spec_async, rel=1e-6)
    assert p["async_plain_vs_sync_plain"] == pytest.approx(sim_plain_sync / sim_plain_async, rel=1e-6)
    assert p["async_spec_vs_sync_plain"] == pytest.approx(sim_plain_sync / sim_spec_async, rel=1e-6)


def test_rollout_speedup_equals_simulated_speculative_decoding():
    """Monte Carlo of verify steps (k drafts, each accepted with probability a until the first
    rejection, plus the bonus token; a step costs c plain steps) against s = tau / c with
    tau = (1 - a^(k+1)) / (1 - a), the expected tokens per verify step (Leviathan et al.)."""
    rng = random.Random(0)
    for k, a, d, v in [(3, 0.6, 0.1, 0.2), (1, 0.4, 0.3, 0.0), (5, 0.8, 0.05, 0.5)]:
        tokens, time = 0, 0.0
        while tokens < 200_000:
            accepted = 0
            while accepted < k and rng.random() < a:
                accepted += 1
            tokens += accepted + 1
            time += 1.0 + k * d + v
        simulated = tokens / time          # plain emits one token per unit time
        tau = (1 - a ** (k + 1)) / (1 - a)
        assert rollout_speedup(tau, step_cost(k, d, v)) == pytest.approx(simulated, rel=0.01)


def test_paper_anchor_rollout_1_77x_at_65_to_72_percent():
    """arXiv 2604.26779: 1.77x rollout speedup with rollouts 65-72% of a synchronous step; its
    end-to-end figures at 8B lie in 1.35-1.5x."""
    lo = project(StageTimes.from_share(0.65), 1.77)["sync_step_speedup"]
    hi = project(StageTimes.from_share(0.72), 1.77)["sync_step_speedup"]
    assert 1.35 < lo < hi < 1.5
    with pytest.raises(ValueError):
        StageTimes.from_share(1.0)


def test_cli_checks_the_paper():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "project_speedup.py"), "--check-paper"],
                         capture_output=True, text=True, check=True).stdout
    lo = project(StageTimes.from_share(0.65), 1.77)["sync_step_speedup"]
    hi = project(StageTimes.from_share(0.72), 1.77)["sync_step_speedup"]
    assert f"projected step speedup {lo:.2f}x-{hi:.2f}x" in out


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
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "project_speedup.py"), "--check-demo", str(path),
                    "--out", str(out_json)], capture_output=True, text=True, check=True)
    check = json.loads(out_json.read_text())
    assert check["measured_rollout_speedup"] == pytest.approx(2.0)
    assert check["projected_step_speedup"] == pytest.approx(10 / 7)
    assert check["measured_step_speedup"] == pytest.approx(10 / 7)
    assert check["measured_other_stages_ratio"] == pytest.approx(1.0)


@pytest.mark.parametrize("k, cost, speedup", [(1, 1.45, 1.0), (1, 1.45, 1.25), (3, 2.3, 1.25), (3, 1.6, 1.0),
                                              (2, 1.9, 1.25)])
def test_acceptance_needed_is_where_simulated_speculation_reaches_the_speedup(k, cost, speedup):
    """The acceptance ``acceptance_needed`` returns, fed to the Monte Carlo of verify steps above, gives
    the asked speedup at that step cost; a little less acceptance falls short."""
    a = acceptance_needed(cost, k, speedup)
    rng = random.Random(1)

    def simulated(acc: float) -> float:
        tokens = steps = 0
        while tokens < 400_000:
            accepted = 0
            while accepted < k and rng.random() < acc:
                accepted += 1
            tokens, steps = tokens + accepted + 1, steps + 1
        return tokens / (steps * cost)

    assert simulated(a) == pytest.approx(speedup, rel=0.01)
    assert simulated(a - 0.05) < speedup * 0.98


def test_acceptance_needed_says_when_no_draft_can_pay():
    assert acceptance_needed(2.6, 1, 1.0) is None          # two tokens a step at most, a step costs 2.6
    assert acceptance_needed(0.9, 3, 1.0) == 0.0            # a step cheaper than plain pays with no acceptance


def test_cli_reads_the_acceptance_needed_off_a_step_cost_report(tmp_path):
    """Cells of a bench_step_cost report (two rounds, held and adaptive rows left out) -> median cost
    and the acceptance it needs."""
    import json

    rows = [{"name": "plain#0", "batch_size": 16},
            {"name": "eagle3_k1_fast#0", "batch_size": 16, "step_cost_vs_plain": 1.4},
            {"name": "eagle3_k1_fast#1", "batch_size": 16, "step_cost_vs_plain": 1.5},
            {"name": "eagle3_k3_held_at_0#0", "batch_size": 16, "step_cost_vs_plain": 1.02},
            {"name": "eagle3_k3_fast", "batch_size": 4, "step_cost_vs_plain": 1.6}]
    path = tmp_path / "step_cost.json"
    path.write_text(json.dumps({"rows": rows, "host": {"cpus": 2}}))
    out = tmp_path / "needed.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "project_speedup.py"), "--acceptance-needed",
                    str(path), "--time-ratio", "0.8", "--out", str(out)], capture_output=True, text=True, check=True)
    cells = {(c["batch_size"], c["k"]): c for c in json.loads(out.read_text())["cells"]}
    assert sorted(cells) == [(4, 3), (16, 1)]
    assert cells[(16, 1)]["step_cost"] == pytest.approx(1.45) and cells[(16, 1)]["rounds"] == 2
    assert cells[(16, 1)]["acceptance_to_break_even"] == pytest.approx(0.45, abs=1e-6)
    assert cells[(16, 1)]["acceptance_for_0.8"] == pytest.approx(1.45 / 0.8 - 1, abs=1e-6)
    assert cells[(4, 3)]["acceptance_for_0.8"] == pytest.approx(acceptance_needed(1.6, 3, 1.25))
