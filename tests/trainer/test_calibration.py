"""Calibration: the trainer's completion-only estimate equals what vLLM serves.

Tiny fixture, float32, T=1, k=3, probabilistic drafting, the warm-started
reduced-vocabulary draft. The engine generates rollouts and counts
``vllm:spec_decode_num_accepted_tokens_per_pos``; the trainer, given the same
rollouts (speculation is lossless, so they are samples of the target), its own
HF features and the draft, estimates those counters
(``served_accept_pos{j}``). They must agree within 0.05 per position over
thousands of drafts. The naive estimates (every position, prompt included;
chained per-step means) are reported beside it in the benchmark table.
"""

import json

import pytest

from helpers import result_json, run_python
from prompts import code_prompts
from vllm_specrl.trainer.calibration import estimate_from_rollouts

K = 3
NUM_PROMPTS = 96
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def served(tiny_model, warm_draft):
    prompts = code_prompts(300 + NUM_PROMPTS)[300:]   # held out: the warm start trained on prompts 200..263
    spec = {"method": "eagle3", "model": str(warm_draft), "num_speculative_tokens": K,
            "draft_sample_method": "probabilistic"}
    out = run_python(f"""
        import json
        from vllm import LLM, SamplingParams
        from vllm_specrl import metrics
        llm = LLM(model={str(tiny_model)!r}, dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=512, max_num_seqs=32, disable_log_stats=False,
                  speculative_config={spec!r})
        prompts = json.loads({json.dumps(json.dumps(prompts))})
        params = [SamplingParams(temperature=1.0, max_tokens={MAX_TOKENS}, ignore_eos=True, seed=i)
                  for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        print("RESULT " + json.dumps({{
            "sequences": [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs],
            "prompt_lengths": [len(o.prompt_token_ids) for o in outs],
            "spec_decode": metrics.from_llm_metrics(llm.get_metrics()).summary()}}))
    """, env={"VLLM_PLUGINS": "specrl"})
    return result_json(out)


@pytest.fixture(scope="module")
def estimate(tiny_model, warm_draft, served):
    return estimate_from_rollouts(tiny_model, warm_draft, served["sequences"], served["prompt_lengths"], K)


def test_served_per_position_acceptance_matches_the_trainer_estimate(served, estimate):
    sd = served["spec_decode"]
    assert sd["num_drafts"] > 1500, sd
    got = sd["per_position_acceptance"]
    want = estimate["served"]
    assert len(got) == K
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.05, {"served": got, "estimate": want}
    assert abs(sd["acceptance_length"] - estimate["served_acceptance_length"]) < 0.1
    # The estimate's draft count is the engine's (same rollouts, its expected draft starts).
    assert abs(estimate["served_drafts"] - sd["num_drafts"]) / sd["num_drafts"] < 0.05
    print(json.dumps({"served": got, **estimate}))
