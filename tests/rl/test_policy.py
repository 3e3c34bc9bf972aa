"""The trainer side of the GRPO loop, against independent computations."""

import pytest
import torch

from vllm_specrl.rl.policy import Policy, clipped_policy_gradient_loss, grpo_advantages


def test_advantages_are_normalised_within_each_group():
    adv = grpo_advantages([1, 0, 0, 0, 1, 1, 0, 0], group=4)
    assert adv[:4].sum().abs() < 1e-6 and adv[4:].sum().abs() < 1e-6
    std = torch.tensor([1.0, 0, 0, 0]).std()
    assert adv[0] == pytest.approx(0.75 / (float(std) + 1e-4), rel=1e-5)


def test_loss_clips_the_ratio_like_ppo():
    lp = [torch.log(torch.tensor([0.5, 0.9]))]
    old = [[float(torch.log(torch.tensor(0.25))), float(torch.log(torch.tensor(0.9)))]]
    # ratios 2.0 and 1.0; positive advantage: the first is clipped to 1.2
    loss = clipped_policy_gradient_loss(lp, old, torch.tensor([1.0]), clip=0.2)
    assert float(loss) == pytest.approx(-(1.2 + 1.0) / 2, rel=1e-5)
    # negative advantage: min(2 * -1, 1.2 * -1) = -2 (the pessimistic side is kept)
    loss = clipped_policy_gradient_loss(lp, old, torch.tensor([-1.0]), clip=0.2)
    assert float(loss) == pytest.approx((2.0 + 1.0) / 2, rel=1e-5)


@pytest.mark.parametrize("micro_batch", [1, 2, 8])
def test_padded_batch_logprobs_equal_one_sequence_at_a_time(tiny_model, micro_batch):
    """Whatever the micro-batching by length, each sample gets its own logprobs, in its own place."""
    policy = Policy(tiny_model, lr=1e-5, seed=0)
    ids = policy.tok("def add(a, b):\n    return a + b\n", add_special_tokens=False)["input_ids"]
    samples = [{"prompt_ids": ids[:3], "completion_ids": ids[3:]},
               {"prompt_ids": ids[:5], "completion_ids": ids[5:7]},
               {"prompt_ids": ids[:2], "completion_ids": ids[2:4]},
               {"prompt_ids": ids[:4], "completion_ids": ids[4:9]}]
    batched = policy.token_logprobs(samples, micro_batch=micro_batch)
    assert [len(x) for x in batched] == [len(s["completion_ids"]) for s in samples]
    with torch.no_grad():
        for s, got in zip(samples, batched):
            seq = torch.tensor([s["prompt_ids"] + s["completion_ids"]])
            logp = torch.log_softmax(policy.model(input_ids=seq).logits[0].float(), -1)
            want = torch.stack([logp[len(s["prompt_ids"]) - 1 + j, t] for j, t in enumerate(s["completion_ids"])])
            assert torch.allclose(got.detach(), want, atol=1e-4)


def test_one_pass_micro_batch_by_micro_batch_updates_the_policy_as_the_whole_batch_does(tiny_model):
    """``grpo_pass`` (each micro-batch back-propagated at once) against ``token_logprobs`` + ``grpo_step``
    (the whole step's graph) from the same weights: the same logprobs, loss and updated parameters."""
    ids = Policy(tiny_model, lr=1e-3, seed=0).tok("def add(a, b):\n    return a + b\n",
                                                    add_special_tokens=False)["input_ids"]
    samples = [{"prompt_ids": ids[:p], "completion_ids": ids[p:p + n], "reward": float(r),
                "vllm_logprobs": [-1.0 - 0.1 * j for j in range(n)]}
               for p, n, r in ((3, 6, 1), (5, 2, 0), (2, 2, 0), (4, 5, 1), (2, 7, 0), (3, 3, 1))]
    whole, streamed = Policy(tiny_model, lr=1e-3, seed=0), Policy(tiny_model, lr=1e-3, seed=0)
    logps = whole.token_logprobs(samples)
    loss = whole.grpo_step(samples, logps, group=3, clip=0.2)
    got, got_loss, forward_s, update_s = streamed.grpo_pass(samples, group=3, clip=0.2, micro_batch=4)
    assert got_loss == pytest.approx(loss, rel=1e-5) and forward_s > 0 and update_s > 0
    for a, b in zip(logps, got):
        assert not b.requires_grad and torch.allclose(a.detach(), b, atol=1e-5)
    before = Policy(tiny_model, lr=1e-3, seed=0).model.state_dict()
    moved = 0.0
    for (name, a), b in zip(whole.model.named_parameters(), streamed.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
        moved = max(moved, float((a - before[name]).abs().max()))
    assert moved > 1e-4  # the step did move the weights
