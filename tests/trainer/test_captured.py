"""Warm-start features captured out of vLLM equal an HF forward of the same rollouts.

An in-process engine (tiny fixture, float32) generates T=1 rollouts with the capture tap on
and a vehicle draft at k = 0; the features it returns are compared with
``trainer.features.sequence_features`` (transformers) on the same token ids: aux and final
hidden states (captured in bf16), the full-vocabulary logsumexp the loss normalises with
(derived from the engine's logprobs), and the first drafted position.

Engines: one in-process capture engine for the module's rollouts and one warm start through it.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import run_function
from vllm_specrl.proposer.eagle3_config import default_aux_layer_ids, read_config
from vllm_specrl.trainer.captured import captured_rollouts
from vllm_specrl.trainer.features import sequence_features
from vllm_specrl.trainer.offline import OfflineConfig, warm_start

PROMPTS = ["def f(x):\n    return", "import os\nimport sys\n", "class A:\n    def __init__(self):",
           "for i in range(10):\n    print("]
PROMPTS.append(PROMPTS[0])  # a prompt seen twice must get fresh samples (random streams per prompt)
SAMPLES = 3


@pytest.fixture(scope="module")
def captured(tiny_model):
    aux = tuple(default_aux_layer_ids(read_config(tiny_model)["num_hidden_layers"]))
    captured = run_function(captured_rollouts, tiny_model, PROMPTS, SAMPLES, 24, 1.0, 0, "float32", aux,
                            max_model_len=512, env={"VLLM_PLUGINS": "specrl"})
    meta = {"sequences": captured.sequences, "prompt_lengths": captured.prompt_lengths,
            "prompt_index": captured.prompt_index, "counts": captured.counts}
    return meta, captured.features, aux


def test_every_rollout_is_captured_whole(captured):
    meta, feats, _ = captured
    counts = meta["counts"]
    assert counts["rollouts"] == len(PROMPTS) * SAMPLES and counts["kept"] == counts["rollouts"], counts
    assert counts["incomplete"] == 0 and counts["sender"]["frames_dropped_queue_full"] == 0, counts
    assert sorted(meta["prompt_index"]) == sorted(i for i in range(len(PROMPTS)) for _ in range(SAMPLES))
    # T=1: the samples of one prompt differ (the engine generated them, not a copy of one).
    for i in range(len(PROMPTS)):
        group = [tuple(s) for s, j in zip(meta["sequences"], meta["prompt_index"]) if j == i]
        assert len(set(group)) > 1, group


def test_a_repeated_prompt_gets_its_own_samples(captured):
    """vLLM seeds a request's n samples seed, seed + 1, ...: one seed shared by every prompt made each
    prompt's rollouts follow the same random streams, so prompts that differ in a few tokens (the demo's
    "What is a + b?") got near-copies of each other's answers (tests/trainer/test_rollout_seeds.py)."""
    meta, _, _ = captured
    first, again = ({tuple(s) for s, j in zip(meta["sequences"], meta["prompt_index"]) if j == i}
                    for i in (0, len(PROMPTS) - 1))
    assert len(first) == len(again) == SAMPLES and not first & again, (first, again)


def test_captured_features_equal_an_hf_forward(captured, tiny_model):
    meta, feats, aux = captured
    target = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ref = sequence_features(target, meta["sequences"], aux, dtype=torch.float32,
                            prompt_lengths=meta["prompt_lengths"])
    for got, want, n_prompt in zip(feats, ref, meta["prompt_lengths"]):
        assert got["token_ids"].tolist() == want["token_ids"].tolist()
        assert int(got["first_draft"]) == want["first_draft"] == n_prompt - 1
        rows = len(want["token_ids"]) - 1  # the last token's row is never computed by the engine
        for key in ("aux_hidden", "final_hidden"):
            a, b = got[key][:rows].float(), want[key][:rows]
            scale = b.pow(2).mean().sqrt()
            # bf16 capture: ~0.4% relative per element; a wrong layer or a shifted row is O(1).
            assert ((a - b).abs().max() / scale) < 0.05, (key, float((a - b).abs().max() / scale))
            assert got[key][rows:].abs().max() == 0
        first = n_prompt - 1
        lse_got, lse_want = got["target_lse"][first:rows], want["target_lse"][first:rows]
        assert torch.allclose(lse_got, lse_want, atol=0.02), (lse_got - lse_want).abs().max()


def test_warm_start_trains_on_captured_features(tiny_model, tmp_path):
    draft = tmp_path / "draft"
    cfg = OfflineConfig(num_prompts=6, samples_per_prompt=2, max_tokens=16, steps=30, batch_size=4,
                        eval_fraction=0.34, chat=False, features="capture")
    summary = run_function(warm_start, tiny_model, draft, None, cfg, draft_vocab_size=256,
                           env={"VLLM_PLUGINS": "specrl"})
    assert summary["features"] == "capture" and summary["rollouts"] == 12, summary
    assert summary["capture"]["kept"] == 12 and summary["capture"]["incomplete"] == 0, summary["capture"]
    assert summary["eval_rollouts"] == 4  # 2 of 6 prompts held out, with both their rollouts
    assert summary["eval_after"]["loss"] < summary["eval_before"]["loss"], summary
    saved = json.loads((draft / "warm_start_rollouts.json").read_text())
    assert len(saved["sequences"]) == 12 and (draft / "config.json").exists()
