"""The torch MTP layer (what the fixtures and the online trainer train) is causal like vLLM's.

vLLM's MTP drafter attends only to earlier rows. The torch layer runs its Qwen2 block without a
mask, which is causal only under SDPA; built from a config that names no attention implementation
(``AutoConfig``, as the online trainer loads it) it used eager attention, every row read the rows
after it, and a layer trained that way promised acceptance vLLM never served (0.76 estimated vs
0.36 served on SmolLM2)."""

import torch
from transformers import AutoConfig

from vllm_specrl.proposer.mtp_torch import MTPLayer


def test_a_row_never_reads_the_rows_after_it(mimo_model):
    config = AutoConfig.from_pretrained(mimo_model)  # no attention implementation named
    layer = MTPLayer(config).eval()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, config.hidden_size, generator=gen)
    embeds = torch.randn(2, 12, config.hidden_size, generator=gen)
    positions = torch.arange(12).expand(2, -1)
    later = hidden.clone()
    later[:, 7:] += 3.0
    with torch.no_grad():
        before, after = layer(hidden, embeds, positions), layer(later, embeds, positions)
    torch.testing.assert_close(after[:, :7], before[:, :7])
    assert not torch.allclose(after[:, 7:], before[:, 7:])
