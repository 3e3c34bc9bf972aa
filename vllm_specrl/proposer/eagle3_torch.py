"""The EAGLE-3 draft as a plain torch module, for training.

Same parameters and math as vLLM's ``Eagle3LlamaForCausalLM`` (which serves
it), so a checkpoint trained here loads there unchanged:

    g      = fc(concat(aux hidden states of the target's layers))
    x      = concat(input_layernorm(embed(token)), hidden_norm(g))      # 2H
    r      = o_proj(attention(x)) + g
    out    = mlp(post_attention_layernorm(r)) + r                       # fed to the next draft step
    logits = lm_head(norm(out))                                         # draft vocabulary

``unroll`` runs the training-time test (TTT): step k at base position t reads
the token at t+1+k and the previous step's output, and attends to step-0 keys
at positions <= t plus its own chain's keys of steps 1..k, exactly what vLLM's
drafter sees at inference.

A draft whose config has ``mask_token_id`` is a parallel (P-EAGLE) draft: vLLM
(``"parallel_drafting": true``) drafts all k tokens in one forward pass, steps
k >= 1 reading the mask token and ``fc(mask_hidden)`` (a learned vector) in
place of the previous step's token and output; the attention pattern and the
positions are the same, so ``unroll`` trains it by swapping those inputs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from vllm_specrl.proposer.eagle3_config import DraftShape


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding (Llama): x [B, heads, T, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Eagle3Attention(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.q_proj = nn.Linear(2 * s.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, s.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Eagle3MLP(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3MidLayer(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Eagle3Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = Eagle3MLP(s)


def _rows_needed(logits_masks: list[torch.Tensor] | None, steps: int) -> list[torch.Tensor] | None:
    """Rows step k must compute: those any step >= k reads (a row's chain feeds only itself)."""
    if logits_masks is None:
        return None
    needed, acc = [], torch.zeros_like(logits_masks[0])
    for k in reversed(range(steps)):
        acc = acc | logits_masks[k]
        needed.append(acc)
    return needed[::-1]


class Eagle3Draft(nn.Module):
    """Trainable EAGLE-3 head; ``embed_tokens`` is the target's and stays frozen."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.config = config
        s = self.shape = DraftShape.from_config(config)
        self.fc = nn.Linear(len(s.aux_layer_ids) * s.target_hidden_size, s.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(s)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.mask_token_id: int | None = config.get("mask_token_id")
        if self.mask_token_id is not None:
            self.mask_hidden = nn.Parameter(torch.zeros(len(s.aux_layer_ids) * s.target_hidden_size))
        if s.draft_vocab_size < s.vocab_size:
            self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(s.vocab_size, dtype=torch.bool))
        else:
            self.d2t = None
            self.t2d = None

    @property
    def parallel(self) -> bool:
        """Trained for vLLM's parallel drafting (all k drafts from one forward pass)."""
        return self.mask_token_id is not None

    def make_parallel(self, mask_token_id: int) -> None:
        """Turn a sequential EAGLE-3 draft into a parallel one: its weights kept, ``mask_hidden``
        starting at zero (training learns it)."""
        if self.parallel:
            return
        self.mask_token_id = int(mask_token_id)
        self.config = dict(self.config, mask_token_id=self.mask_token_id)
        width = len(self.shape.aux_layer_ids) * self.shape.target_hidden_size
        self.mask_hidden = nn.Parameter(torch.zeros(width, device=self.fc.weight.device))

    # -- vocabulary mapping ---------------------------------------------------------
    def draft_token_ids(self) -> torch.Tensor:
        """Target id of each draft-vocabulary entry."""
        base = torch.arange(self.shape.draft_vocab_size, device=self.lm_head.weight.device)
        return base if self.d2t is None else base + self.d2t

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Use the given (sorted, unique) target token ids as the draft vocabulary."""
        if self.d2t is None:
            raise ValueError("this draft uses the full target vocabulary")
        target_ids = target_ids.sort().values.to(self.d2t.device)
        if target_ids.numel() != self.shape.draft_vocab_size:
            raise ValueError(f"need {self.shape.draft_vocab_size} ids, got {target_ids.numel()}")
        self.d2t.copy_(target_ids - torch.arange(target_ids.numel(), device=target_ids.device))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    # -- forward --------------------------------------------------------------------
    def unroll(self, aux_hidden: torch.Tensor, token_ids: torch.Tensor, steps: int,
               positions: torch.Tensor | None = None,
               logits_masks: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Draft logits [B, T, draft_vocab] for each of ``steps`` TTT steps.

        With ``logits_masks`` (one [B, T] bool mask per step, the positions a loss reads) only the
        rows a loss can see are computed past the attention scores: the LM head where step k's
        mask is set, the output projection and MLP where any step >= k's mask is set (a row's
        later steps read its own earlier output; every other row contributes only its step-0
        keys and values, which come before the MLP). Other rows of the logits stay 0. Prompt and
        padding rows are most of a batch, so this is most of a training step's compute, and the
        rows the loss reads are computed exactly as without masks.

        aux_hidden: [B, T, n_aux * H_target] target states at positions 0..T-1.
        token_ids:  [B, T] tokens; step k at index t consumes token t+1+k
                    (indices past the end read token 0 and must be masked by the loss).
        """
        b, t, _ = aux_hidden.shape
        layer, s = self.midlayer, self.shape
        if positions is None:
            positions = torch.arange(t, device=aux_hidden.device)
        # A parallel draft's later steps read the mask state, not a row's earlier output.
        needed = logits_masks if self.parallel else _rows_needed(logits_masks, steps)
        hidden = self.fc(aux_hidden)
        causal = torch.ones(t, t, dtype=torch.bool, device=aux_hidden.device).tril()
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        scale = 1.0 / math.sqrt(s.head_dim)
        outputs = []
        mask_state = self.fc(self.mask_hidden) if self.parallel else None
        for k in range(steps):
            shifted = torch.zeros_like(token_ids)
            if k > 0 and mask_state is not None:
                shifted.fill_(self.mask_token_id)
                hidden = mask_state.to(hidden.dtype).expand(b, t, -1)
            elif 1 + k < t:
                shifted[:, : t - 1 - k] = token_ids[:, 1 + k :]
            emb = layer.input_layernorm(self.embed_tokens(shifted))
            x = torch.cat([emb, layer.hidden_norm(hidden)], dim=-1)
            cos, sin = rope_cos_sin(positions + k, s.head_dim, s.rope_theta)
            q, key, val = layer.self_attn.qkv(x, cos, sin)
            keys.append(key)
            values.append(val)
            scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
            scores += [((q * keys[j]).sum(-1, keepdim=True) * scale) for j in range(1, k + 1)]
            probs = torch.cat(scores, dim=-1).float().softmax(-1).to(q.dtype)
            attn = probs[..., :t] @ values[0]
            for j in range(1, k + 1):
                attn = attn + probs[..., t + j - 1 : t + j] * values[j]
            attn = attn.transpose(1, 2).reshape(b, t, -1)
            if needed is None:
                residual = layer.self_attn.o_proj(attn) + hidden
                out = layer.mlp(layer.post_attention_layernorm(residual)) + residual
                outputs.append(self.lm_head(self.norm(out)))
                hidden = out
                continue
            rows, mask = needed[k], logits_masks[k]
            residual = layer.self_attn.o_proj(attn[rows]) + hidden[rows]
            out = layer.mlp(layer.post_attention_layernorm(residual)) + residual
            logits = out.new_zeros(b, t, self.lm_head.out_features)
            logits[mask] = self.lm_head(self.norm(out[mask[rows]]))
            outputs.append(logits)
            hidden = hidden.new_zeros(b, t, hidden.shape[-1]).index_put((rows,), out)
        return outputs

    # -- checkpoint names (the stock EAGLE-3 layout) ---------------------------------
    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights as saved: everything but the shared embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens")}
