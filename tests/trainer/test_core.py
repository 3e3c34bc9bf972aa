"""The training core learns from real target features, and resumes from its checkpoint."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from prompts import code_prompts
from vllm_specrl.proposer.checkpoint import init_draft, load_draft, target_lm_head
from vllm_specrl.trainer.core import DraftTrainer, TrainConfig, collate
from vllm_specrl.trainer.features import sequence_features


@pytest.fixture(scope="module")
def features(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    target = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    seqs = [tok(p + "\n" + p)["input_ids"][:48] for p in code_prompts(40, length=120)]
    draft = init_draft(tiny_model, None, seed=0)
    return sequence_features(target, seqs, draft.shape.aux_layer_ids)


def test_features_match_the_target_logits(tiny_model, features):
    head = target_lm_head(tiny_model).float()
    target = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    item = features[0]
    logits = target(input_ids=item["token_ids"][None]).logits[0]
    torch.testing.assert_close(item["final_hidden"].float() @ head.T, logits, rtol=0.05, atol=0.1)


def test_training_improves_acceptance_and_resumes(tiny_model, features, tmp_path):
    trainer = DraftTrainer(init_draft(tiny_model, None, seed=0), target_lm_head(tiny_model),
                           TrainConfig(lr=2e-3, ttt_steps=2))
    eval_batch = collate(features[:8])
    before = trainer.evaluate(eval_batch)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        idx = torch.randperm(len(features) - 8, generator=g)[:8] + 8
        trainer.step(collate([features[i] for i in idx.tolist()]))
    after = trainer.evaluate(eval_batch)
    assert after["loss"] < before["loss"] - 0.3, (before["loss"], after["loss"])
    assert after["expected_accept_step0"] > before["expected_accept_step0"] + 0.05

    out = trainer.save(tmp_path / "draft")
    resumed = DraftTrainer.from_checkpoint(out, tiny_model, TrainConfig(lr=2e-3, ttt_steps=2))
    assert resumed.step_count == 40
    assert resumed.optimizer.state_dict()["state"], "optimizer state must be restored"
    reloaded = load_draft(out, tiny_model)
    for (n, a), (_, b) in zip(trainer.unwrapped.state_dict().items(), reloaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)
    torch.testing.assert_close(resumed.evaluate(eval_batch)["loss"], after["loss"], rtol=1e-4, atol=1e-4)
