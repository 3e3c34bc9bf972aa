"""A MiMo-style multi-token-prediction (MTP) layer as a plain torch module, for training.

Same parameters and math as vLLM's ``MiMoMultiTokenPredictorLayer`` (which serves
it under ``--speculative-config '{"method": "mtp", ...}'``), so the tensors
trained here load there unchanged, under the checkpoint names
``model.mtp_layers.{i}.*`` that MiMo checkpoints use:

    e      = token_layernorm(embed(x[p+1]))           (zero at position 0, as vLLM does)
    h      = hidden_layernorm(body_hidden[p])         (the body's last layer, before its norm)
    out    = final_layernorm(block(input_proj(concat(h, e))))      # predicts x[p+2]
    logits = lm_head(out)                             (the body's own head, shared)

``block`` is a Qwen2 decoder layer (transformers' own). Chained drafts (k > 1)
feed ``out`` back as the next position's ``body_hidden`` with the drafted token,
exactly what vLLM's drafter loop does with one MTP layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

MTP_PREFIX = "model.mtp_layers."


class MTPLayer(nn.Module):
    """One MTP layer on a Qwen2 body; embeddings and LM head are the body's (passed in)."""

    def __init__(self, config: Any):
        super().__init__()
        import copy

        from transformers.models.qwen2.modeling_qwen2 import (
            Qwen2DecoderLayer,
            Qwen2RMSNorm,
            Qwen2RotaryEmbedding,
        )

        # The block runs without an attention mask, which is causal only under SDPA (``is_causal``
        # when a query has several rows). A config from ``AutoConfig`` names no implementation, and
        # eager attention without a mask lets every row read the rows after it: a layer trained that
        # way learns from the future and drafts worse than it trained. So: SDPA, always.
        config = copy.copy(config)
        config._attn_implementation = "sdpa"

        h, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.hidden_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.block = Qwen2DecoderLayer(config, layer_idx=0)
        self.final_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.rotary = Qwen2RotaryEmbedding(config)

    def forward(self, body_hidden: torch.Tensor, next_embeds: torch.Tensor,
                positions: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, H] body states at p, embeddings of x[p+1], positions p -> [B, T, H] normed outputs.
        ``attention_mask`` ([B, 1, T, T] bool, True: attend) replaces the causal mask (draft chains)."""
        next_embeds = torch.where(positions.unsqueeze(-1) == 0, 0.0, next_embeds)
        x = self.input_proj(torch.cat([self.hidden_layernorm(body_hidden),
                                       self.token_layernorm(next_embeds)], dim=-1))
        cos_sin = self.rotary(x, positions)
        x = self.block(x, attention_mask=attention_mask, position_ids=positions, position_embeddings=cos_sin)
        return self.final_layernorm(x)

    def checkpoint_tensors(self, index: int = 0) -> dict[str, torch.Tensor]:
        """This layer's tensors under MiMo's checkpoint names (``model.mtp_layers.{index}.*``)."""
        out = {}
        for name, tensor in self.state_dict().items():
            if name.startswith("rotary."):
                continue
            out[f"{MTP_PREFIX}{index}.{name.removeprefix('block.')}"] = tensor.detach().clone()
        return out

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], index: int = 0) -> None:
        """Inverse of ``checkpoint_tensors``; every parameter must be present with its shape."""
        prefix = f"{MTP_PREFIX}{index}."
        own = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        wanted = {}
        for name in own:
            key = prefix + name.removeprefix("block.")
            if key not in tensors:
                raise KeyError(f"MTP tensor {key} missing")
            wanted[name] = tensors[key]
        self.load_state_dict(wanted, strict=False)

    def init_from_body_layer(self, body_layer: nn.Module) -> None:
        """Start the block from a body decoder layer (as MiMo's MTP layers are initialised)."""
        self.block.load_state_dict(body_layer.state_dict())


def body_features(body: Any, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(last layer's output before the final norm [B, T, H], logits [B, T, V]) of an HF Qwen2 body."""
    captured: list[torch.Tensor] = []
    handle = body.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out))
    try:
        logits = body(input_ids=input_ids).logits
    finally:
        handle.remove()
    return captured[0], logits


def mtp_logits(layer: MTPLayer, body: Any, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced MTP logits: row p predicts ``input_ids[p + 2]`` (rows 0..T-2)."""
    embeds = body.get_input_embeddings()(input_ids[:, 1:])
    positions = torch.arange(input_ids.shape[1] - 1).expand(input_ids.shape[0], -1)
    return body.lm_head(layer(hidden[:, :-1], embeds, positions))


def draft_chain(layer: MTPLayer, body: Any, seq: list[int], base: int,
                drafts: list[int]) -> torch.Tensor:
    """[k, V] draft distributions (softmax, T=1) at ``base``: what vLLM's MTP drafter proposes there.

    ``seq[: base + 2]`` is committed (``seq[base + 1]`` is the token sampled at ``base``); draft j > 0
    reads draft j-1 and the MTP output before it.
    """
    with torch.no_grad():
        ids = torch.tensor(seq[: base + 2])[None]
        hidden, _ = body_features(body, ids[:, : base + 1])
        embed = body.get_input_embeddings()
        inputs_h, inputs_e = hidden, embed(ids[:, 1:])
        probs = []
        for j in range(len(drafts)):
            positions = torch.arange(inputs_h.shape[1])[None]
            out = layer(inputs_h, inputs_e, positions)
            probs.append(body.lm_head(out[0, -1]).softmax(-1))
            inputs_h = torch.cat([inputs_h, out[:, -1:]], 1)
            inputs_e = torch.cat([inputs_e, embed(torch.tensor([[drafts[j]]]))], 1)
        return torch.stack(probs)
