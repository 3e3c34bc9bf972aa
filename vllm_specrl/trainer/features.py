"""Target features for draft training from an HF transformers forward pass.

vLLM's aux hidden state for layer id k is the residual stream entering layer
k (pre-norm), which is ``hidden_states[k]`` of an HF forward with
``output_hidden_states=True`` for k < L; the last entry of that tuple is the
final *post-norm* state, the LM head's input, which the loss needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_specrl.cpu.malloc import large_blocks_mapped


@torch.no_grad()
def target_features(model, token_ids: torch.Tensor, aux_layer_ids: Sequence[int],
                    attention_mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(aux [B, T, n_aux*H], final post-norm hidden [B, T, H], logsumexp of the logits [B, T])
    for right-padded ``token_ids``. The logsumexp lets the loss normalise the target's
    distribution over the full vocabulary without a full-vocabulary matmul per step."""
    num_layers = model.config.num_hidden_layers
    bad = [i for i in aux_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"aux layer ids {bad} must be in 0..{num_layers - 1} for HF features")
    out = model(input_ids=token_ids, attention_mask=attention_mask, output_hidden_states=True)
    states = out.hidden_states
    aux = torch.cat([states[i] for i in aux_layer_ids], dim=-1)
    return aux.float(), states[-1].float(), out.logits.float().logsumexp(-1)


@large_blocks_mapped()
def sequence_features(model, sequences: list[list[int]], aux_layer_ids: Sequence[int],
                      batch_size: int = 8, dtype: torch.dtype = torch.bfloat16,
                      prompt_lengths: Sequence[int] | None = None) -> list[dict[str, torch.Tensor]]:
    """Per-sequence {token_ids, aux_hidden, final_hidden, target_lse, first_draft}, hidden states
    stored in ``dtype`` to save memory. ``first_draft`` = prompt length - 1 (0 without lengths).
    Each batch's logits are mapped and unmapped, not kept on the heap of a training process
    (``cpu_malloc.large_blocks_mapped``)."""
    items = []
    device = next(model.parameters()).device
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        t = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), t, dtype=torch.long)
        mask = torch.zeros(len(chunk), t, dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        aux, final, lse = target_features(model, ids.to(device), aux_layer_ids, mask.to(device))
        for i, s in enumerate(chunk):
            n = len(s)
            first = max(prompt_lengths[start + i] - 1, 0) if prompt_lengths is not None else 0
            items.append({"token_ids": ids[i, :n].clone(), "aux_hidden": aux[i, :n].to(dtype).cpu(),
                          "final_hidden": final[i, :n].to(dtype).cpu(), "target_lse": lse[i, :n].cpu(),
                          "first_draft": first})
    return items
