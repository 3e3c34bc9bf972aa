"""The MTP trainer's chained draft positions (k > 1) are the drafts vLLM's MTP drafter makes.

``MTPTrainer.chain_logprobs`` unrolls positions 1..k-1 for every base in one masked pass; the
reference is ``draft_chain`` (the torch replay of vLLM's drafter, one base at a time, which the
engine parity test holds against vLLM's own proposals). Checked on the tiny-mimo fixture with its
HF body supplying the states vLLM would capture.
"""

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
