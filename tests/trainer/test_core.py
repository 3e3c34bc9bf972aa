"""The training core learns from real target features, and resumes from its checkpoint."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from prompts import code_prompts
from vllm_specrl.proposer.checkpoint import init_draft, load_draft, target_lm_head
from vllm_specrl.trainer.core import (DraftTrainer, TrainConfig, collate, resolve_mixed_precision,
                                      resolve_serving_dtype)
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


@pytest.mark.parametrize("native, precision, dtype", [((True, False), "bf16", "bfloat16"),
                                                     ((False, True), "bf16", "bfloat16"),
                                                     ((False, False), "no", "float32")])
def test_auto_precision_is_bf16_only_where_the_cpu_multiplies_it_natively(monkeypatch, native, precision, dtype):
    """Training precision and serving dtype resolve alike: `make demo` serves at the dtype its draft's
    rollouts were generated at."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native[0])
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: native[1])
    assert resolve_mixed_precision("auto") == precision
    assert resolve_mixed_precision("no") == "no" and resolve_mixed_precision("bf16") == "bf16"
    with pytest.raises(ValueError, match="mixed_precision"):
        resolve_mixed_precision("fp16")
    assert resolve_serving_dtype("auto") == dtype
    assert resolve_serving_dtype("float32") == "float32" and resolve_serving_dtype("bfloat16") == "bfloat16"


def test_bf16_training_runs_in_bf16_and_learns_as_fp32_does(tiny_model, features):
    """Same start, same batches: the bf16 trainer's matrix multiplies run in bf16 (what makes it
    2x faster on an AVX512-BF16 CPU) and it ends within 0.1 nats of fp32's held-out loss (the
    SmolLM2 demo draft: held-out acceptance length 1.87 at 150 steps in both)."""
    eval_batch = collate(features[:8])
    results, seen = {}, {}
    for precision in ("no", "bf16"):
        trainer = DraftTrainer(init_draft(tiny_model, None, seed=0), target_lm_head(tiny_model),
                               TrainConfig(lr=2e-3, ttt_steps=2, mixed_precision=precision))
        before = trainer.evaluate(eval_batch)["loss"]
        def record(module, args, out, p=precision):  # training steps only
            seen.setdefault(p, out.dtype)

        hook = trainer.unwrapped.fc.register_forward_hook(record)
        g = torch.Generator().manual_seed(0)
        for _ in range(10):  # bf16 is emulated (slow) on CPUs without AVX512-BF16/AMX, as CI's may be
            idx = torch.randperm(len(features) - 8, generator=g)[:8] + 8
            trainer.step(collate([features[i] for i in idx.tolist()]))
        hook.remove()
        results[precision] = (before, trainer.evaluate(eval_batch)["loss"])
    assert seen == {"no": torch.float32, "bf16": torch.bfloat16}, seen
    (before32, after32), (before16, after16) = results["no"], results["bf16"]
    assert before16 == pytest.approx(before32, abs=1e-5)  # evaluation stays fp32
    assert after32 < before32 - 0.3 and abs(after16 - after32) < 0.1, results


def test_a_cpu_trainer_on_a_machine_with_a_gpu_asks_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert resolve_mixed_precision("auto") == "bf16"
    assert resolve_mixed_precision("auto", on_cpu=True) == "no"


def test_feature_noise_scales_with_each_channel():
    from vllm_specrl.trainer.core import with_feature_noise

    torch.manual_seed(0)
    scales = torch.tensor([0.01, 1.0, 100.0])   # a target's hidden states: a few channels far larger
    aux = (torch.randn(4, 2000, 3) * scales).to(torch.bfloat16)
    noisy = with_feature_noise(aux, 0.2)
    assert noisy.dtype == torch.bfloat16
    noise = noisy.float() - aux.float()
    ratio = noise.reshape(-1, 3).std(dim=0) / aux.float().reshape(-1, 3).std(dim=0)
    torch.testing.assert_close(ratio, torch.full((3,), 0.2), rtol=0.1, atol=0.0)
    assert noise.reshape(-1, 3).mean(dim=0).abs().lt(0.02 * scales).all()


def test_feature_noise_trains_on_noisy_features_and_evaluates_on_clean_ones(tiny_model, features):
    batch = collate(features[:8])

    def trainer(noise: float) -> DraftTrainer:
        return DraftTrainer(init_draft(tiny_model, None, seed=0), target_lm_head(tiny_model),
                            TrainConfig(lr=2e-3, ttt_steps=2, feature_noise=noise, seed=0))

    clean, noisy = trainer(0.0), trainer(0.5)
    assert noisy.evaluate(batch)["loss"] == noisy.evaluate(batch)["loss"] == clean.evaluate(batch)["loss"]
    clean.step(batch)
    noisy.step(batch)
    moved = [(a - b).abs().max().item() for a, b in zip(clean.unwrapped.parameters(), noisy.unwrapped.parameters())]
    assert max(moved) > 1e-5, "the noisy trainer's step must see other features than the clean one's"
    twin = trainer(0.0)
    twin.step(batch)
    for a, b in zip(clean.unwrapped.parameters(), twin.unwrapped.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_start_anchor_pulls_each_step_back_toward_the_starting_weights(tiny_model, features):
    """With ``start_anchor`` a step is the plain step, then every trainable weight moves lr * anchor of the
    way back to where the trainer started (not toward zero, as weight decay does)."""
    batch = collate(features[:8])

    def trainer(anchor: float) -> DraftTrainer:
        return DraftTrainer(init_draft(tiny_model, None, seed=0, target_layer=-1), target_lm_head(tiny_model),
                            TrainConfig(lr=2e-3, ttt_steps=2, start_anchor=anchor, seed=0))

    plain, anchored = trainer(0.0), trainer(50.0)
    start = [p.detach().clone() for p in anchored.unwrapped.parameters() if p.requires_grad]
    fraction = 2e-3 * 50.0
    plain.step(batch)
    anchored.step(batch)
    moved = 0.0
    for a, b, s0 in zip([p for p in plain.unwrapped.parameters() if p.requires_grad],
                        [p for p in anchored.unwrapped.parameters() if p.requires_grad], start):
        moved = max(moved, (a - s0).abs().max().item())
        torch.testing.assert_close(b, a + fraction * (s0 - a), rtol=1e-6, atol=1e-6)
    assert moved > 1e-4, "the plain step must move the weights, or the check above says nothing"


def test_per_start_acceptance_pools_to_the_served_estimate(tiny_model, features):
    """``acceptance`` hands out the per-start weights behind ``evaluate``'s served estimate: pooled by
    ``served_acceptance`` they must give the same acceptance length (a script mixes them with another
    source's weights, so they must be the ones the estimate is made of)."""
    from vllm_specrl.trainer.acceptance import served_acceptance

    trainer = DraftTrainer(init_draft(tiny_model, None, seed=0), target_lm_head(tiny_model), TrainConfig(ttt_steps=3))
    prompted = [dict(f, first_draft=5) for f in features[:8]]
    batch = collate(prompted)
    steps = trainer.acceptance(batch)
    assert len(steps.valid) == len(steps.accept_weight) == 3
    assert not steps.valid[0][:, :5].any(), "no draft starts before the prompt's last position"
    pooled = served_acceptance(steps, batch.first)["acceptance_length"]
    assert pooled == pytest.approx(trainer.evaluate(batch)["served_acceptance_length"], rel=1e-6)
