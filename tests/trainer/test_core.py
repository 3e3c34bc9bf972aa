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


def test_cosine_schedule_warms_up_decays_and_is_applied(tiny_model):
    import math

    from vllm_specrl.trainer.core import scheduled_lr

    cfg = TrainConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=10, total_steps=100, min_lr_ratio=0.1)
    lrs = [scheduled_lr(cfg, s) for s in range(101)]
    assert lrs[0] == pytest.approx(1e-4 * (0.1 + 0.9 * 0.5 * (1 + math.cos(0))))
    assert lrs[9] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.09))))
    assert lrs[50] == pytest.approx(1e-3 * 0.55)
    assert lrs[100] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert scheduled_lr(TrainConfig(lr=3e-3), 12345) == 3e-3
    with pytest.raises(ValueError, match="total_steps"):
        scheduled_lr(TrainConfig(lr_schedule="cosine"), 0)
    # The trainer's optimizer runs at the scheduled rate, counted from where this run started.
    trainer = DraftTrainer(init_draft(tiny_model, None, seed=0), target_lm_head(tiny_model), cfg)
    trainer.step_count = trainer.schedule_origin = 40
    batch = _random_batch(trainer)
    assert trainer.step(batch)["lr"] == pytest.approx(lrs[0])
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(lrs[0])
    assert trainer.step(batch)["lr"] == pytest.approx(lrs[1])


def _random_batch(trainer: DraftTrainer):
    s = trainer.unwrapped.shape
    g = torch.Generator().manual_seed(0)
    seqs = [{"token_ids": torch.randint(0, s.vocab_size, (12,), generator=g),
             "aux_hidden": torch.randn(12, len(s.aux_layer_ids) * s.target_hidden_size, generator=g),
             "final_hidden": torch.randn(12, s.target_hidden_size, generator=g), "first_draft": 3}
            for _ in range(2)]
    return collate(seqs)
