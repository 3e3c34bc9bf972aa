"""The MTP trainer's chained draft positions (k > 1) are the drafts vLLM's MTP drafter makes.

``MTPTrainer.chain_logprobs`` unrolls positions 1..k-1 for every base in one masked pass; the
reference is ``draft_chain`` (the torch replay of vLLM's drafter, one base at a time, which the
engine parity test holds against vLLM's own proposals). Checked on the tiny-mimo fixture with its
HF body supplying the states vLLM would capture.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from vllm_specrl.proposer.mtp_torch import body_features, draft_chain
from vllm_specrl.trainer.mtp import MTPTrainer

K = 3


def test_every_chained_position_equals_the_drafter_replayed_one_base_at_a_time(mimo_model):
    torch.manual_seed(0)
    body = AutoModelForCausalLM.from_pretrained(mimo_model, dtype=torch.float32).eval()
    trainer = MTPTrainer(mimo_model)
    ids = torch.randint(3, body.config.vocab_size, (40,)).tolist()
    with torch.no_grad():
        hidden, _ = body_features(body, torch.tensor([ids]))
    seq = {"final_hidden": hidden[0], "next_token_ids": torch.tensor(ids[1:] + [-1]), "start": 0,
           "first_draft": 6}
    chain = trainer.chain_logprobs(seq, K)
    assert [len(rows) for _, rows in chain] == [32 - j for j in range(K)]  # bases 6..37-j: tokens known
    for base in (6, 17, 30):
        reference = draft_chain(trainer.layer, body, ids, base, ids[base + 2: base + 2 + K]).log()
        for j, (logprobs, rows) in enumerate(chain):
            (at,) = (rows == base).nonzero()[0]
            torch.testing.assert_close(logprobs[at], reference[j], atol=2e-4, rtol=0)


def sampled_features(body, n: int, length: int, seed: int) -> list[dict]:
    """T=1 samples of the body with the features the capture path hands the MTP trainer."""
    gen = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        ids = torch.randint(3, body.config.vocab_size, (1, 4), generator=gen)
        with torch.no_grad():
            for _ in range(length):
                logits = body(input_ids=ids).logits[0, -1]
                ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=gen)[None]], 1)
            hidden, logits = body_features(body, ids)
        tokens = ids[0]
        logprobs = logits[0, :-1].log_softmax(-1).gather(-1, tokens[1:, None])[:, 0]
        items.append({"final_hidden": hidden[0], "next_token_ids": torch.cat([tokens[1:], torch.tensor([-1])]),
                      "logprobs": torch.cat([logprobs, torch.tensor([float("nan")])]), "start": 0,
                      "first_draft": 3, "body_logits": logits[0]})
    return items


def test_the_loss_is_the_decay_weighted_soft_cross_entropy_of_every_chained_position(mimo_model):
    """Independent reference: the body's own logits at row s + j + 1 are the target of position j."""
    from vllm_specrl.trainer.core import TrainConfig

    body = AutoModelForCausalLM.from_pretrained(mimo_model, dtype=torch.float32).eval()
    seqs = sampled_features(body, 2, 24, seed=1)
    for ttt in (1, K):
        trainer = MTPTrainer(mimo_model, TrainConfig(ttt_steps=ttt, decay=0.5))
        terms = []
        for j in range(ttt):
            num, den = 0.0, 0
            for seq in seqs:
                logprobs, rows = trainer.chain_logprobs(seq, ttt)[j]
                policy = seq["body_logits"][rows + j + 1].log_softmax(-1).exp()
                num, den = num - float((policy * logprobs).sum()), den + len(rows)
            terms.append(num / den)
        reference = sum(0.5 ** j * t for j, t in enumerate(terms)) / sum(0.5 ** j for j in range(ttt))
        assert trainer.train_on(seqs)["loss"] == pytest.approx(reference, rel=1e-4)

