"""The benchmark harness sweeps every method end to end and reports ratios against plain vLLM.

Engines: the benchmark harness end to end, one engine per method and temperature (slow tier); its
pure functions are tested without engines.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_rollout_sweep_on_tiny(tiny_model, warm_draft, tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_rollout.py"),
                    "--model", str(tiny_model), "--warm-draft", str(warm_draft),
                    "--methods", "plain,ngram,eagle3-random,eagle3-warm", "--ks", "2",
                    "--temperatures", "0,1", "--batch-sizes", "2", "--waves", "1",
                    "--prompts", "2", "--samples", "2", "--max-tokens", "16", "--ignore-eos",
                    "--dtype", "float32", "--max-model-len", "512", "--phases", "--out", str(out)],
                   check=True, timeout=900)
    report = json.loads(out.read_text())
    cells = report["cells"]
    assert not [c for c in cells if "error" in c], cells
    assert {(c["method"], c["temperature"]) for c in cells} == {
        (m, t) for m in ("plain", "ngram", "eagle3-random", "eagle3-warm") for t in (0.0, 1.0)}
    for c in cells:
        assert c["tokens"] == 2 * 16 and c["batch_size"] == 2
        # --phases: the runner's phases fit inside the cell's wall time, the target's forward inside a
        # step, and only speculative engines propose (their drafter's deferred KV counted beside).
        phases = c["phases_s"]
        assert 0 < phases["target_forward"] < phases["step"] < c["wall_s"]
        assert phases["outside_runner"] == pytest.approx(c["wall_s"] - phases["step"], abs=1e-3)
        assert 0 < phases["schedule"] + phases["update_from_output"] < phases["outside_runner"]
        counts = c["phase_counts"]
        assert counts["steps"] >= c["tokens"] / (2 * (c["k"] + 1))  # at most k + 1 tokens a request a step
        assert (phases["propose"] > 0) == (c["method"] != "plain")
        assert ("deferred_steps_deferred" in counts) == c["method"].startswith("eagle3")
        if c["method"] != "plain":
            assert c["k"] == 2 and c["spec_decode"]["num_drafts"] > 0
            assert c["throughput_ratio_vs_plain"] > 0
            assert c["step_cost_vs_plain"] > 0
    # The random draft is built with the warm draft's reduced vocabulary (same cost).
    random_cfg = json.loads((Path(report["drafts"]["eagle3-random"]) / "config.json").read_text())
    assert random_cfg["draft_vocab_size"] == 1024
    assert Path(report["plot"]).stat().st_size > 10_000


def _bench_rollout_module():
    return load_script("scripts/bench/bench_rollout.py")


def test_answers_end_at_eos_unless_fixed_lengths_are_asked_for():
    """RL rollouts end at EOS; text past it is no rollout's, and a draft accepts less there."""
    parser = _bench_rollout_module().build_parser()
    assert parser.parse_args([]).ignore_eos is False
    assert parser.parse_args(["--stop-at-eos"]).ignore_eos is False
    assert parser.parse_args(["--ignore-eos"]).ignore_eos is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--ignore-eos", "--stop-at-eos"])


def test_rounds_are_compared_within_a_round_and_pooled_over_rounds():
    """--rounds: each round's cell against that round's plain; the pooled ratio from summed tokens and
    wall time (not a mean of ratios), acceptance from summed counters."""
    bench = _bench_rollout_module()

    def cell(method, rnd, tokens, wall, drafts=0, accepted=0, k=0):
        return {"method": method, "k": k, "round": rnd, "temperature": 1.0, "batch_size": 4, "tokens": tokens,
                "wall_s": wall, "tokens_per_s": tokens / wall,
                "spec_decode": {"num_drafts": drafts, "num_accepted_tokens": accepted} if drafts else None}

    cells = [cell("plain", 0, 100, 10.0), cell("eagle3-warm", 0, 100, 5.0, 50, 50, k=3),
             cell("plain", 1, 100, 20.0), cell("eagle3-warm", 1, 100, 25.0, 80, 20, k=3)]
    bench.add_ratios(cells)
    assert [c.get("throughput_ratio_vs_plain") for c in cells] == [None, 2.0, None, 0.8]
    (row,) = [r for r in bench.pool_rounds(cells) if r["method"] == "eagle3-warm"]
    assert row["rounds"] == 2 and row["round_ratios"] == [2.0, 0.8]
    assert row["throughput_ratio_vs_plain"] == 1.0      # 200 tokens / 30 s against 200 / 30 s
    assert (row["round_ratio_min"], row["round_ratio_max"]) == (0.8, 2.0)
    assert row["spec_decode"]["acceptance_length"] == 1.0 + 70 / 130


def test_interleaved_slices_are_measured_in_rotating_order_and_compared_slice_by_slice(monkeypatch, tmp_path):
    """--interleave: every engine started once, then each slice on each engine in turn (the first one
    rotating), and each slice's cell against plain's cell of the same slice, not of another."""
    import argparse

    import bench_engine

    bench = _bench_rollout_module()
    started, asked = [], []

    class FakeEngine:
        def __init__(self, script, cfg, env, log_path, timeout_s):
            assert cfg["interleave"] is True
            self.name = cfg["name"]
            started.append(self.name)
            if self.name == "broken":
                raise RuntimeError("engine exited before ENGINE_READY")

        def request(self, command):
            assert command["rewarm"] is True  # every slice re-warms its engine before measuring
            asked.append((self.name, command["slice"]))
            wall = {"plain": [10.0, 20.0], "spec": [5.0, 40.0]}[self.name][command["slice"]]
            return [{"temperature": 1.0, "batch_size": 4, "tokens": 100, "wall_s": wall,
                     "tokens_per_s": 100 / wall, "spec_decode": None}]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(bench_engine, "EngineProcess", FakeEngine)
    engines = [("plain", 0, None), ("spec", 3, {"method": "eagle3"}), ("broken", 1, {"method": "ngram"})]
    cfgs = [{"name": "plain", "log_dir": str(tmp_path), "speculative_config": None},
            {"name": "spec", "log_dir": str(tmp_path), "speculative_config": {"method": "eagle3"}},
            {"name": "broken", "log_dir": str(tmp_path), "speculative_config": {"method": "ngram"}}]
    args = argparse.Namespace(interleave=2, rounds=1, engine_timeout=10)
    cells, failed = [], []
    for (method, k, spec), slice_index, res in bench.run_interleaved(engines, cfgs, args, 0):
        if isinstance(res, str):  # an engine that did not start: its slices are errors, the others run
            failed.append((method, slice_index, res))
            continue
        cells += [{"method": method, "k": k, "round": 0, "slice": slice_index, **c} for c in res]
    assert started == ["plain", "spec", "broken"]
    assert asked == [("plain", 0), ("spec", 0), ("spec", 1), ("plain", 1)]
    assert [(m, i) for m, i, _ in failed] == [("broken", 0), ("broken", 1)] and "ENGINE_READY" in failed[0][2]
    bench.add_ratios(cells)
    assert sorted(c["throughput_ratio_vs_plain"] for c in cells if c["method"] == "spec") == [0.5, 2.0]
    (row,) = [r for r in bench.pool_rounds(cells) if r["method"] == "spec"]
    assert row["throughput_ratio_vs_plain"] == 200 / 45 / (200 / 30)


def test_explain_prompts_are_the_rl_tasks_own_and_chat_prompts_are_held_out():
    """``--prompt-set explain`` measures the prompts an RL run samples every epoch (and the demo draft is
    warm-started on): all of the task's 81, never dropped as "trained on"; ``chat`` drops them."""
    from vllm_specrl.rl.tasks import distinct_prompts

    bench = _bench_rollout_module()
    task = set(distinct_prompts(81, seed=0, task="explain"))
    assert len(task) == 81
    assert set(bench.make_prompts(81, "explain", exclude=task)) == task
    assert len(set(bench.make_prompts(8, "explain"))) == 8
    chat = bench.make_prompts(16, "chat")
    held_out = bench.make_prompts(16, "chat", exclude=set(chat[:4]))
    assert len(held_out) == 16 and not set(chat[:4]) & set(held_out)


def test_refill_keeps_the_batch_full_until_the_queue_is_empty():
    """``--refill``: a request starts in the step after one ends, so `batch` decode together until
    the last requests drain; waves would wait for their slowest sequence."""
    from types import SimpleNamespace

    class Engine:
        def __init__(self):
            self.left, self.lengths, self.batches = {}, {}, []

        def add_request(self, request_id, prompt, params):
            self.left[request_id] = self.lengths[request_id] = params

        def has_unfinished_requests(self):
            return bool(self.left)

        def step(self):
            self.batches.append(len(self.left))
            for rid in self.left:
                self.left[rid] -= 1
            done = [rid for rid, n in self.left.items() if n == 0]
            for rid in done:
                del self.left[rid]
            return [SimpleNamespace(finished=True, outputs=[SimpleNamespace(token_ids=[0] * self.lengths[rid])])
                    for rid in done]

    steps = [3, 9, 4, 4, 2, 6, 5, 1]  # each request's steps (its "params" here)
    engine = Engine()
    tokens = _bench_rollout_module()._run_refilled(engine, [("p", n) for n in steps], batch=3)
    assert tokens == sum(steps)
    # Full while requests wait; it only shrinks in the final drain.
    first_short = next(i for i, b in enumerate(engine.batches) if b < 3)
    assert all(b < 3 for b in engine.batches[first_short:]) and max(engine.batches) == 3, engine.batches
    assert sum(engine.batches) == sum(steps) and len(engine.batches) == 12, engine.batches


def test_an_adaptive_variant_is_its_own_engine_with_its_knobs_over_the_runs():
    """--adaptive-variant: a rule against the default in one run. The variant's engine gets its knobs over
    --adaptive-config's and the adaptive scheduler; the default adaptive engine keeps the run's knobs."""
    bench = _bench_rollout_module()
    variants = bench.adaptive_variants({"burst": 5, "speculate_margin": 0.05}, [{"speculate_margin": 0}])
    assert variants == {"eagle3-warm-v0-adaptive": {"burst": 5, "speculate_margin": 0}}
    base = {"model": "m", "adaptive_config": {"burst": 5, "speculate_margin": 0.05}}
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    variant = bench.engine_config(base, "eagle3-warm-v0-adaptive", 3, spec, variants)
    default = bench.engine_config(base, "eagle3-warm-adaptive", 3, spec, variants)
    plain = bench.engine_config(base, "plain", 0, None, variants)
    assert variant["name"] == "eagle3-warm-v0-adaptive_k3" and variant["adaptive_config"]["speculate_margin"] == 0
    assert default["adaptive_config"]["speculate_margin"] == 0.05
    assert variant["scheduler_cls"] == default["scheduler_cls"] == bench.ADAPTIVE_SCHEDULER
    assert plain["scheduler_cls"] is None and plain["name"] == "plain"
