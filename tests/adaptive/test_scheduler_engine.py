"""Adaptive k inside a real engine (tiny fixture, float32, in-process): lossless greedy, and the
k it settles on when drafts are never accepted (a random draft) or nearly always (ngram on a
repeating prompt). The temperature-1 test with adaptive k is in tests/test_lossless_sampling.py.

Engines: one in-process engine per case (plain, adaptive k with a random draft, with ngram): each
case's scheduler settles from an empty state, which a shared engine would not start from.
"""


from safetensors.torch import load_file, save_file

from prompts import code_prompts
from sampling import greedy_generate
from vllm_specrl.adaptive import SCHEDULER_CLS
from vllm_specrl.proposer.checkpoint import init_draft

K = 3
REPEATING = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2, 3]\nv ="


def eagle3(draft_dir) -> dict:
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": K,
            "draft_sample_method": "probabilistic"}


def test_greedy_with_adaptive_k_equals_plain(tiny_model, warm_draft):
    prompts = code_prompts(32)
    plain = greedy_generate(tiny_model, prompts, 40, max_num_seqs=8)
    # Undecayed acceptance counts (decay 1), so they can be compared with vLLM's counters.
    adaptive = greedy_generate(tiny_model, prompts, 40, eagle3(warm_draft), scheduler_cls=SCHEDULER_CLS,
                               max_num_seqs=8, additional_config={"specrl": {"adaptive_k": {"decay": 1.0}}})
    assert adaptive["tokens"] == plain["tokens"]
    state, served = adaptive["adaptive_k"], adaptive["spec_decode"]
    # The controller counts every verify as vLLM's spec_decode counters do, also the last one of a request
    # that max_tokens stops mid-draft (vLLM trims its sampled tokens in place after counting them).
    assert state["acceptance_drafts"][0] == served["num_drafts"], (state, served)
    assert sum(state["acceptance_accepted"]) == served["num_accepted_tokens"], (state, served)
    assert sum(1 for n in state["chosen_k_counts"] if n) >= 2, state
    # The worker's runner time reached the scheduler, and was less than the whole interval.
    assert state["step_overhead_ms"] is not None and state["step_overhead_ms"] > 0, state
    # vLLM really drafted fewer than K tokens on some steps (its own counters say so).
    assert served["num_draft_tokens"] < K * served["num_drafts"], served


def never_accepted_draft(tiny_model, out):
    """A draft whose logits are all zero: at greedy it always proposes token 0, which the target
    does not emit on the repeating prompt (checked below from vLLM's counters)."""
    init_draft(tiny_model, out, seed=0)
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"].zero_()
    save_file(weights, out / "model.safetensors")
    return out


def test_a_draft_that_is_never_accepted_settles_on_k0(tiny_model, tmp_path):
    draft = never_accepted_draft(tiny_model, tmp_path / "never")
    out = greedy_generate(tiny_model, [REPEATING], 460, eagle3(draft), scheduler_cls=SCHEDULER_CLS, max_num_seqs=4)
    state = out["adaptive_k"]
    assert out["spec_decode"]["num_drafts"] > 0 and out["spec_decode"]["num_accepted_tokens"] == 0, \
        out["spec_decode"]  # the premise
    assert state["buckets"]["1-1"]["calibrated"] and state["buckets"]["1-1"]["best_k"] == 0, state
    assert state["chosen_k_counts"][0] > 0.6 * sum(state["chosen_k_counts"]), state


def test_drafts_that_are_mostly_accepted_settle_on_max_k(tiny_model):
    # The tiny fixture is rebuilt from scratch on every fresh machine and its greedy text on the
    # repeating prompt differs between builds (0.69-0.84+ of ngram drafts accepted); lookups of
    # 2-4 tokens keep the premise well clear of the bound.
    ngram = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    out = greedy_generate(tiny_model, [REPEATING], 460, ngram, scheduler_cls=SCHEDULER_CLS, max_num_seqs=4)
    state = out["adaptive_k"]
    assert out["spec_decode"]["acceptance_rate"] > 0.6, out["spec_decode"]  # the premise
    assert state["buckets"]["1-1"]["calibrated"] and state["buckets"]["1-1"]["best_k"] == K, state
    counts = state["chosen_k_counts"]  # calibration measures every k first (starting at k = 0)
    assert counts[K] == max(counts), state
