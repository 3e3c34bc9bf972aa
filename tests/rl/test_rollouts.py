"""Rollout bookkeeping: every (task, sample) exactly once per step."""

import pytest

from vllm_specrl.rl.rollouts import bulk_and_tail, check_rollouts


def _samples(ids):
    return [{"rollout_id": i} for i in ids]


def test_complete_step_passes():
    check_rollouts(_samples(["0/0/0", "0/0/1", "0/1/0", "0/1/1"]), step=0, tasks=2, group=2)


@pytest.mark.parametrize("ids", [["0/0/0", "0/0/1", "0/1/0"], ["0/0/0", "0/0/1", "0/1/0", "0/1/0"],
                                 ["0/0/0", "0/0/1", "0/1/0", "1/1/1"]])
def test_lost_duplicated_or_foreign_rollouts_are_refused(ids):
    with pytest.raises(RuntimeError, match="lost or duplicated"):
        check_rollouts(_samples(ids), step=0, tasks=2, group=2)


class _FakeEngine:
    """Answers ``/v1/completions`` like vLLM and records each request's seed, expanded the way vLLM
    seeds the samples of an ``n > 1`` request (sample j: seed + j). Its answers end at EOS after
    ``eos_after`` tokens unless the request ignores EOS, and never run past ``max_tokens``."""

    def __init__(self, eos_after: int = 1):
        self.sample_seeds = []
        self.eos_after = eos_after

    def post(self, url, timeout, json):
        from unittest.mock import Mock

        self.sample_seeds += [json["seed"] + j for j in range(json["n"])]
        n_tokens = json["max_tokens"] if json.get("ignore_eos") else min(json["max_tokens"], self.eos_after)
        choices = [{"index": j, "prompt_token_ids": [1], "token_ids": [2] * n_tokens, "text": "4",
                    "logprobs": {"token_logprobs": [-0.1]}} for j in range(json["n"])]
        return Mock(headers={"x-specrl-policy-version-start": "0", "x-specrl-policy-version": "0"},
                    json=lambda: {"choices": choices}, raise_for_status=lambda: None)


def test_every_sample_of_consecutive_steps_has_its_own_random_stream(monkeypatch):
    """With ``seed + i`` per prompt, prompt i's sample 1 and prompt i+1's sample 0 shared one
    seed: rollouts of different prompts drew the same random numbers (planted: fails here)."""
    from vllm_specrl.rl import rollouts

    engine = _FakeEngine()
    monkeypatch.setattr(rollouts.requests, "post", engine.post)
    prompts, group = ["a", "b", "c", "d"], 4
    for step in range(3):
        samples, _ = rollouts.sample_groups("http://engine", "m", prompts, group, 8,
                                            seed=step * len(prompts) * group, step=step,
                                            score=lambda i, text: 0.0)
        check_rollouts(samples, step, len(prompts), group)
    assert len(engine.sample_seeds) == 3 * len(prompts) * group
    assert len(set(engine.sample_seeds)) == len(engine.sample_seeds)


def test_answers_generated_again_have_exactly_the_lengths_asked_for(monkeypatch):
    """``generate_at_lengths`` holds sample j of prompt i to ``lengths[i][j]`` tokens even where the
    model would stop at EOS sooner (planted: without ``ignore_eos`` the long ones come back short),
    one request per sample, each with its own seed."""
    from vllm_specrl.rl import rollouts

    engine = _FakeEngine(eos_after=5)
    monkeypatch.setattr(rollouts.requests, "post", engine.post)
    lengths = [[3, 40, 7], [256, 1, 12]]
    timing, produced = rollouts.generate_at_lengths("http://engine", "m", ["a", "b"], lengths, seed=100)
    assert produced == lengths and timing["generation_s"] >= 0
    assert sorted(engine.sample_seeds) == list(range(100, 106))


def test_bulk_ends_when_half_of_the_groups_are_done():
    assert bulk_and_tail([3.0, 1.0, 7.0, 5.0], 9.0) == {"generation_s": 9.0, "bulk_s": 3.0, "tail_s": 6.0}
    assert bulk_and_tail([2.0], 4.0)["bulk_s"] == 2.0


def test_a_replay_splits_its_answers_where_their_groups_are_done(monkeypatch):
    """The replay at the same lengths sends one request per answer; a prompt's group is done when its
    last answer is (planted: taking the group's last-listed answer instead puts the bulk's end at 7 here). Each
    answer 'finishes' at a clock time equal to its length, on a fake clock; the main thread reads 0 and then 300."""
    import threading

    from vllm_specrl.rl import rollouts

    engine, local, main_reads = _FakeEngine(eos_after=5), threading.local(), iter([0.0, 300.0])

    def post(url, timeout, json):
        local.now = float(json["max_tokens"])
        return engine.post(url, timeout, json)

    monkeypatch.setattr(rollouts.requests, "post", post)
    monkeypatch.setattr(rollouts.time, "perf_counter", lambda: getattr(local, "now", None) or next(main_reads))
    timing, _ = rollouts.generate_at_lengths("http://engine", "m", ["a", "b"], [[3, 40, 7], [256, 1, 12]], seed=0)
    assert timing == {"generation_s": 300.0, "bulk_s": 40.0, "tail_s": 260.0}
