"""The history proposer without an engine: it times the steps it sees for its cost fit (rows counted
with the drafts they verified, steps where requests joined left out) and drafts by the threshold
the fit gives for the batch at hand. A fake clock plays a CPU where a step costs 40 ms + 9 ms a row."""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_specrl.proposer.history import HistoryProposer

FIXED_S, PER_ROW_S = 0.040, 0.009
PROMPT = np.arange(100, 120, dtype=np.int32)
CONTEXT = np.concatenate([PROMPT, [1, 2]]).astype(np.int32)   # every live sequence: prompt + "1 2"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def proposer(**history):
    # max_sequences: the finished test requests must not push out the six rollouts; max_match: matches of 2
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3),
                          model_config=SimpleNamespace(max_model_len=256, get_vocab_size=lambda: 512, seed=0),
                          additional_config={"specrl": {"history": {"max_sequences": 1024, "max_match": 2, **history}}})
    prop = HistoryProposer(cfg)
    key, _ = prop.index.group(PROMPT)
    for i in range(6):   # six earlier rollouts agree on "3 4 5 6": estimates 0.57, 0.37, 0.25 chained
        prop.index.add_completion(key, np.arange(1, 7, dtype=np.int32), 0, f"old{i}")
    return prop


def step(prop, req_ids):
    rows = len(req_ids)
    prop.bind_step(SimpleNamespace(req_ids=req_ids, num_prompt_tokens=np.full(rows, len(PROMPT)),
                                   temperature_cpu=None), None)
    tokens = np.zeros((rows, 64), dtype=np.int32)
    tokens[:, :len(CONTEXT)] = CONTEXT
    return prop.propose([[2]] * rows, np.full(rows, len(CONTEXT)), tokens)


def run_rollouts(prop, clock, waves=3):
    """Waves of 16 requests that end a few at a time; each step's time is the cost of its rows (its
    sequences plus the drafts they verify). Returns the clean steps the proposer should have timed."""
    clean, n = 0, 0
    for _ in range(waves):
        ids = [f"r{n + i}" for i in range(16)]
        n += 16
        drafts = {}
        first = True
        while ids:
            clock.now += FIXED_S + PER_ROW_S * (len(ids) + sum(drafts.get(r, 0) for r in ids))
            if first:
                clock.now += 0.5   # the requests' prompts ran in this step too: not a decode step
            out = step(prop, ids)
            clean += not first
            first = False
            drafts = {r: len(d) for r, d in zip(ids, out)}
            ids = ids[:-1] if len(ids) > 4 else ids[:-2] if len(ids) > 1 else []
    return clean


def test_the_proposer_fits_its_steps_and_drafts_by_the_batch(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("time.perf_counter", clock)
    prop = proposer()
    clean = run_rollouts(prop, clock)
    status = prop.specrl_status()["step_cost"]
    assert status["clean_steps"] == clean
    assert status["per_row_ms"] == pytest.approx(1e3 * PER_ROW_S, rel=0.02)
    assert status["fixed_ms"] == pytest.approx(1e3 * FIXED_S, rel=0.05)
    # Thresholds 0.18 / 0.47 / 0.78 at 1 / 4 / 16 sequences against chained estimates 0.57, 0.37, 0.25.
    assert [len(d) for d in step(prop, ["a"])] == [3]
    assert {len(d) for d in step(prop, [f"b{i}" for i in range(4)])} == {1}
    assert {len(d) for d in step(prop, [f"c{i}" for i in range(16)])} == {0}


def test_without_cost_aware_the_fixed_threshold_drafts_at_every_batch(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("time.perf_counter", clock)
    prop = proposer(cost_aware=False, min_confidence=0.2)
    run_rollouts(prop, clock)
    assert {len(d) for d in step(prop, [f"c{i}" for i in range(16)])} == {3}
    assert {len(d) for d in step(prop, ["a"])} == {3}


def test_the_proposers_own_time_per_step_is_reported(monkeypatch):
    """A clock that moves 2 ms at every read: each call reads it when it starts and when it ends (the
    start also ends the last step for the cost fit), so the proposer reports 2 ms of its own a step."""
    clock = Clock()

    def ticking():
        clock.now += 0.002
        return clock.now

    monkeypatch.setattr("time.perf_counter", ticking)
    prop = proposer()
    for _ in range(5):
        step(prop, ["a", "b"])
    assert prop.specrl_status()["propose_ms_per_step"] == pytest.approx(2.0)
