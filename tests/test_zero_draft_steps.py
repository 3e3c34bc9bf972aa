"""Steps without drafts take the plain sampler and a short spec-decode metadata path
(``cpu.sampling_patches.install_zero_draft_plain_sampler``) and are followed by no draft fetch
(``cpu.skip_draft_fetch.install_skip_empty_draft_fetch``).

An EAGLE-3 engine held at k = 0 by vLLM's own batch-size table drafts nothing, so with
the plugin every decode step skips the rejection sampler. Its seeded temperature-1
tokens and their logprobs must be exactly plain vLLM's (same seeds, float32), and the
runner must have counted the steps it routed; vLLM's own path (the knob off) gives
the same tokens, so the shortcut changes cost, not output. The engine core skips the
draft fetch after those steps, and only those: where the table asks for drafts (one
request left), they must still reach the scheduler and be verified.

Engines: in-process engines with and without each patch (switched by environment at start-up),
compared token for token.
"""

from pathlib import Path

import pytest

from helpers import in_engine_process, run_function
from prompts import code_prompts
from vllm_specrl.cpu.skip_draft_fetch import SKIP_EMPTY_DRAFT_FETCH_ENV
from vllm_specrl.cpu.sampling_patches import ZERO_DRAFT_ENV

PROMPTS = code_prompts(8)


def seeded_generation(model: Path, speculative_config: dict | None) -> dict:
    """Seeded T = 1 samples of ``PROMPTS`` with their logprobs, and how many steps took each shortcut."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
              max_num_seqs=8, speculative_config=speculative_config)
    params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=100 + i, logprobs=1)
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {"skipped": getattr(llm.llm_engine.engine_core.engine_core, "_specrl_skipped_draft_fetches", 0),
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in outs],
            "routed": llm.collective_rpc(lambda w: getattr(w.model_runner, "_specrl_zero_draft_steps", 0))[0],
            "short_metadata": llm.collective_rpc(
                lambda w: getattr(w.model_runner, "_specrl_zero_draft_metadata", 0))[0]}


@in_engine_process(env={"VLLM_PLUGINS": "specrl"})
def k_zero_then_k_three(model: Path, spec: dict) -> dict:
    """Two greedy requests (8 and 40 tokens): both at k = 0, then the longer one alone at k = 3."""
    from vllm import LLM, SamplingParams

    from vllm_specrl import metrics

    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
              max_num_seqs=8, speculative_config=spec, disable_log_stats=False)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (8, 40)]
    llm.generate(PROMPTS[:2], params, use_tqdm=False)
    return {"skipped": getattr(llm.llm_engine.engine_core.engine_core, "_specrl_skipped_draft_fetches", 0),
            "drafts": metrics.from_llm_metrics(llm.get_metrics()).summary()}


def seeded_run(model: Path, speculative_config: dict | None, env: dict | None = None) -> dict:
    return run_function(seeded_generation, model, speculative_config, env={"VLLM_PLUGINS": "specrl", **(env or {})})


@pytest.fixture(scope="module")
def held_at_zero(tiny_model, tmp_path_factory):
    from vllm_specrl.proposer.checkpoint import init_draft

    draft = tmp_path_factory.mktemp("zero-draft") / "draft"
    init_draft(tiny_model, draft, 1024, seed=5)
    return {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic", "num_speculative_tokens_per_batch_size": [[1, 64, 0]]}


@pytest.fixture(scope="module")
def plain(tiny_model):
    return seeded_run(tiny_model, None)


@pytest.fixture(scope="module")
def spec_at_zero(tiny_model, held_at_zero):
    return seeded_run(tiny_model, held_at_zero)


def test_zero_draft_steps_sample_exactly_as_plain_vllm(spec_at_zero, plain):
    spec = spec_at_zero
    assert spec["routed"] >= 23, spec["routed"]  # every decode step of the wave had no drafts
    assert spec["short_metadata"] >= 23, spec["short_metadata"]
    assert spec["tokens"] == plain["tokens"]
    flat = lambda rows: [x for row in rows for x in row]  # noqa: E731
    assert flat(spec["logprobs"]) == pytest.approx(flat(plain["logprobs"]), abs=1e-5)


def test_vllm_rejection_path_gives_the_same_tokens(tiny_model, held_at_zero, plain):
    stock = seeded_run(tiny_model, held_at_zero, env={ZERO_DRAFT_ENV: "0"})
    assert stock["routed"] == stock["short_metadata"] == 0
    assert stock["tokens"] == plain["tokens"]


def test_no_draft_fetch_follows_a_step_without_drafts(tiny_model, held_at_zero, spec_at_zero, plain):
    spec = spec_at_zero
    assert spec["skipped"] >= 23, spec["skipped"]
    stock = seeded_run(tiny_model, held_at_zero, env={SKIP_EMPTY_DRAFT_FETCH_ENV: "0"})
    assert stock["skipped"] == 0
    assert spec["tokens"] == stock["tokens"] == plain["tokens"]


def test_drafts_asked_for_are_still_fetched_and_verified(tiny_model, warm_draft):
    """Two requests at k = 0, then the longer one alone at k = 3: its drafts must be verified."""
    spec = {"method": "eagle3", "model": str(warm_draft), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic", "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 0]]}
    out = k_zero_then_k_three(tiny_model, spec)
    # ~32 steps alone at k = 3 (fewer when drafts are accepted): every one verified 3 drafts
    assert out["drafts"]["num_draft_tokens"] >= 3 * 10, out
    assert 5 <= out["skipped"] <= 8, out  # the steps both requests ran (k = 0), not the tail's
