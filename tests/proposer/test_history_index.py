"""The history index: what it drafts from (siblings, earlier rollouts, own text), how long, how it ages,
and that its memory stays under its cap (measured with tracemalloc, not taken from its own count)."""

import tracemalloc

import numpy as np
import pytest

from vllm_specrl.proposer.history_index import HistoryConfig, HistoryIndex, prompt_key
from vllm_specrl.proposer.history_replay import replay

PROMPT = np.arange(100, 120, dtype=np.int32)
TAIL = 4


def arr(*tokens):
    return np.asarray(tokens, dtype=np.int32)


def index(**kw):
    return HistoryIndex(HistoryConfig(prompt_tail=TAIL, **kw))


def draft_for(ix, key, live, me, k=3):
    """Draft tokens for live sequence ``me`` (its prompt tail + completion) of group ``key``."""
    full = np.concatenate([PROMPT, live[me][TAIL:]])
    return ix.draft(ix.corpus(key, live), full[-ix.cfg.max_match:], k).tokens


def with_tail(*completion):
    return np.concatenate([PROMPT[-TAIL:], arr(*completion)])


def test_a_sibling_ahead_drafts_its_continuation():
    ix = index(min_confidence=0.05)
    key, _ = ix.group(PROMPT)
    ahead = with_tail(1, 2, 3, 4, 5, 6, 7)
    behind = with_tail(1, 2, 3)
    assert draft_for(ix, key, [ahead, behind], 1) == [4, 5, 6]
    # The sibling at the same point has nothing to draft from the other one (nor from itself).
    assert draft_for(ix, key, [with_tail(1, 2, 3), with_tail(9, 9, 9)], 0) == []


def test_own_text_drafts_like_ngram_but_never_its_own_end():
    ix = index(min_confidence=0.05)
    key, _ = ix.group(PROMPT)
    repeating = with_tail(7, 8, 9, 10, 11, 7, 8)
    assert draft_for(ix, key, [repeating], 0) == [9, 10, 11]
    assert draft_for(ix, key, [with_tail(7, 8, 9, 10)], 0) == []


def test_earlier_rollouts_of_the_same_prompt_only():
    ix = index(min_confidence=0.05)
    key, _ = ix.group(PROMPT)
    ix.add_completion(key, arr(1, 2, 3, 4, 5), version=0, request_id="old")
    assert draft_for(ix, key, [with_tail(1, 2)], 0) == [3, 4, 5]
    # At the start of a completion the match runs across the prompt tail.
    assert draft_for(ix, key, [with_tail(1)], 0) == [2, 3, 4]
    other_prompt = PROMPT + 1
    other, _ = ix.group(other_prompt)
    assert other != key
    full = np.concatenate([other_prompt, arr(1, 2)])
    assert ix.draft(ix.corpus(other, [np.concatenate([other_prompt[-TAIL:], arr(1, 2)])]), full, 3).tokens == []


def test_draft_length_follows_agreement():
    """Continuations that agree give a long draft; where they split evenly the draft stops."""
    ix = index(min_confidence=0.3)
    key, _ = ix.group(PROMPT)
    for i in range(6):
        ix.add_completion(key, arr(1, 2, 3, 4, 5, 6), 0, f"agree{i}")
    assert draft_for(ix, key, [with_tail(1, 2)], 0, k=4) == [3, 4, 5, 6]
    ix2 = index(min_confidence=0.3)
    key2, _ = ix2.group(PROMPT)
    for i in range(6):
        ix2.add_completion(key2, arr(1, 2, 3, 40 + i % 2, 5, 6), 0, f"split{i}")
    assert draft_for(ix2, key2, [with_tail(1, 2)], 0, k=4) == [3]
    # One lone earlier rollout matched on 2 tokens: an estimate of 2/3 x 1/2 = 0.33 for its next token.
    for threshold, expected in ((0.3, [3]), (0.4, [])):
        ix3 = index(min_confidence=threshold)
        key3, _ = ix3.group(PROMPT)
        ix3.add_completion(key3, arr(50, 1, 2, 3), 0, "lone")
        assert draft_for(ix3, key3, [with_tail(60, 70, 1, 2)], 0) == expected


def test_a_policy_update_ages_history():
    ix = index(min_confidence=0.05, age_decay=0.25, max_age=1)
    key, _ = ix.group(PROMPT)
    for i in range(3):  # three old rollouts say 7 ...
        ix.add_completion(key, arr(1, 2, 7), 0, f"old{i}")
    ix.set_policy_version(1)
    ix.add_completion(key, arr(1, 2, 8), 1, "new")  # ... one new one says 8
    # Same version: 3 votes beat 1. One version later the old ones weigh 0.25 each: 0.75 < 1.
    assert draft_for(ix, key, [with_tail(1, 2)], 0, k=1) == [8]
    ix.set_policy_version(3)  # two versions behind max_age=1: the old ones are gone, "new" too
    assert ix.status()["completions"] == 0 and ix.counts["completions_aged_out"] == 4
    assert draft_for(ix, key, [with_tail(1, 2)], 0, k=1) == []


def test_same_votes_before_aging_pick_the_majority():
    ix = index(min_confidence=0.05, age_decay=0.25, max_age=1)
    key, _ = ix.group(PROMPT)
    for i in range(3):
        ix.add_completion(key, arr(1, 2, 7), 0, f"old{i}")
    ix.add_completion(key, arr(1, 2, 8), 0, "new")
    assert draft_for(ix, key, [with_tail(1, 2)], 0, k=1) == [7]


def test_memory_stays_under_its_cap_with_many_prompts():
    cap = 2 << 20
    ix = HistoryIndex(HistoryConfig(max_bytes=cap, max_sequences=8))
    rng = np.random.default_rng(0)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    peak_over = 0
    for p in range(3000):
        prompt = rng.integers(0, 50_000, 40, dtype=np.int32)
        key, _ = ix.group(prompt)
        for g in range(4):
            ix.add_completion(key, rng.integers(0, 50_000, 200, dtype=np.int32), 0, f"{p}-{g}")
        if p % 500 == 499:
            used = tracemalloc.get_traced_memory()[0] - base
            peak_over = max(peak_over, used - cap)
            assert ix.nbytes <= cap
    tracemalloc.stop()
    # Far more was added (3000 prompts x 4 x 800 B = 9.6 MB) than kept; what the process holds
    # for the index (dict entries, keys, arrays) stays within a quarter over the token cap.
    assert ix.counts["groups_evicted"] > 2000
    assert peak_over < cap // 4, peak_over


def test_lru_keeps_the_prompts_in_use():
    ix = HistoryIndex(HistoryConfig(max_prompts=3))
    prompts = [PROMPT + i for i in range(4)]
    keys = [ix.group(p)[0] for p in prompts[:3]]
    ix.group(prompts[0])  # used again: now the most recent
    ix.group(prompts[3])  # evicts the least recently used, prompts[1]
    assert list(ix.groups) == [keys[2], keys[0], prompt_key(prompts[3])]


def test_unknown_or_inconsistent_knobs_are_refused():
    with pytest.raises(ValueError, match="unknown history keys"):
        HistoryConfig.from_dict({"max_byte": 1})
    with pytest.raises(ValueError, match="min_match"):
        HistoryConfig.from_dict({"min_match": 5, "max_match": 3})


def test_replay_counts_what_a_rejection_sampler_would():
    """Two identical epochs of one repeating sequence: epoch 1 drafts the whole sequence from epoch 0."""
    completion = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    epochs = [[(list(PROMPT), completion)], [(list(PROMPT), completion)]]
    out = replay(epochs, 3, HistoryConfig(prompt_tail=TAIL, min_confidence=0.05))
    first, second = out["epochs"]
    assert first["num_drafts"] == 0
    # Epoch 1: the first token comes from prefill, then 8 tokens in steps of 4 (3 accepted + 1).
    assert second["steps"] == 2 and second["num_drafts"] == 2
    assert second["per_position_acceptance"] == [1.0, 1.0, 1.0]


def test_sampled_drafts_follow_the_shares_they_report():
    """Three siblings went 4-5, 4-6 and 9-7 after the shared context 1 2 3. A sampled draft's first
    token is 4 with probability 2/3 and reports {4: 2/3, 9: 1/3}; its second is drawn among the
    siblings that agree with the first (after 4: 5 or 6, half each; after 9: 7). A draft of the
    heaviest token (no rng) is always 4 and reports nothing. vLLM accepts a sampled draft with
    min(1, p / q): lossless only if the token really is drawn from the q reported, so both the draws'
    frequencies and the reported q are checked against the counts written here."""
    ix = index(min_confidence=0.01)
    key, _ = ix.group(PROMPT)
    live = [with_tail(1, 2, 3, 4, 5), with_tail(1, 2, 3, 4, 6), with_tail(1, 2, 3, 9, 7), with_tail(1, 2, 3)]
    rng = np.random.default_rng(0)
    full = np.concatenate([PROMPT, live[3][TAIL:]])
    corpus = ix.corpus(key, live)
    draws = [ix.draft(corpus, full[-ix.cfg.max_match:], 2, rng) for _ in range(3000)]
    firsts = np.array([d.tokens[0] for d in draws])
    assert abs((firsts == 4).mean() - 2 / 3) < 0.03, (firsts == 4).mean()
    for d in draws:
        ids, q = d.dists[0]
        assert dict(zip(ids.tolist(), np.round(q, 6).tolist())) == {4: round(2 / 3, 6), 9: round(1 / 3, 6)}
        ids, q = d.dists[1]
        want = {5: 0.5, 6: 0.5} if d.tokens[0] == 4 else {7: 1.0}
        assert dict(zip(ids.tolist(), q.tolist())) == want and d.tokens[1] in want
    seconds = np.array([d.tokens[1] for d in draws if d.tokens[0] == 4])
    assert abs((seconds == 5).mean() - 0.5) < 0.04
    heaviest = ix.draft(corpus, full[-ix.cfg.max_match:], 2)
    assert heaviest.tokens[0] == 4 and heaviest.dists is None


def test_shares_along_a_continuation_are_what_the_sampled_draft_reports_on_that_path():
    """``shares_along`` (for estimates from rollouts) must give, step by step, the q the sampled draft
    reports when its draws were the continuation's tokens, and stop where that path leaves the
    continuations (or where the draft would stop). Reference: ``draft`` itself, sampled many times,
    on the draws that followed each path."""
    ix = index(min_confidence=0.01)
    key, _ = ix.group(PROMPT)
    live = [with_tail(1, 2, 3, 4, 5, 8), with_tail(1, 2, 3, 4, 6, 8), with_tail(1, 2, 3, 9, 7, 8),
            with_tail(1, 2, 3)]
    full = np.concatenate([PROMPT, live[3][TAIL:]])
    corpus = ix.corpus(key, live)
    context = full[-ix.cfg.max_match:]
    rng = np.random.default_rng(1)
    seen = {}
    for _ in range(400):
        d = ix.draft(corpus, context, 3, rng)
        seen.setdefault(tuple(d.tokens), d.dists)
    assert {(4, 5, 8), (4, 6, 8), (9, 7, 8)} <= set(seen)
    for path, dists in seen.items():
        along = ix.shares_along(corpus, context, arr(*path), 3)
        assert len(along) == len(dists) == 3
        for (ids, q), (want_ids, want_q) in zip(along, dists):
            assert ids.tolist() == want_ids.tolist() and np.allclose(q, want_q)
    # A continuation the history never wrote: the first step's shares, then nothing (rejected there).
    off = ix.shares_along(corpus, context, arr(7, 7, 7), 3)
    assert len(off) == 1 and off[0][0].tolist() == [4, 9]
    # Leaving after one matching step: two steps, the second among the siblings that agreed on 4.
    left = ix.shares_along(corpus, context, arr(4, 7, 8), 3)
    assert [ids.tolist() for ids, _ in left] == [[4, 9], [5, 6]]
    # The draft's own stopping rule applies: a threshold no step reaches gives nothing.
    assert ix.shares_along(corpus, context, arr(4, 5, 8), 3, min_confidence=0.99) == []
