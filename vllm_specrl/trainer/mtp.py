"""Keep the policy's own MTP layer aligned with the policy, from what vLLM streams out.

An engine serving ``"method": "mtp"`` hands its MTP drafter the body's last hidden
state of every row; the capture tap sends those rows (``"drafter": "mtp"`` frames,
``final_hidden`` = the state the drafter reads, for MiMo before the final norm).
Row ``i`` of a captured sequence then gives one teacher-forced MTP example, exactly
the input vLLM's drafter sees when it drafts from base ``i``:

    input  = (final_hidden[i], embed(next_token_ids[i]))         at position start + i
    target = the policy's distribution of next_token_ids[i + 1]  (row i + 1's logits:
             lm_head(norm(final_hidden[i + 1])))

The loss is the soft cross-entropy against that distribution (the MTP layer learns
what the policy would sample, as the fixture's MTP layer was trained), on completion
rows only (vLLM drafts from the last prompt row on). vLLM drafts k > 1 tokens by feeding
the one layer its own output, so ``TrainConfig.ttt_steps`` positions are trained on that
chain (position j weighted ``decay**j``; its target is the policy at row i + j + 1), as
EAGLE-3's training-time test does: a layer trained on position 0 alone serves later
positions from inputs it never saw. The estimate of vLLM's counters
(``estimate_served``) uses the engine's own logprob of each emitted token and the
draft-start walk of ``trainer.acceptance``, for every draft position: position j > 0
feeds the layer its own output at position j - 1 and the token drafted there (the
emitted one, when the earlier positions were accepted), attending to the committed
rows and its own chain, which ``chain_logprobs`` unrolls for every base at once.

Published with ``update_draft``: an MTP engine takes exactly its MTP tensors there
(``model.mtp_layers.*``), validated against the served checkpoint's; a policy update
that carries MTP tensors replaces them with the policy trainer's copy, after which
this trainer's next publish brings its own back.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vllm_specrl.proposer.checkpoint import target_embedding, target_final_norm, target_lm_head
from vllm_specrl.proposer.mtp_torch import MTP_PREFIX, MTPLayer
from vllm_specrl.trainer.acceptance import StepAcceptance, pool, served_acceptance
from vllm_specrl.trainer.core import (
    TRAINER_META,
    TRAINER_STATE,
    TrainConfig,
    resolve_mixed_precision,
    scheduled_lr,
)

MTP_WEIGHTS = "mtp.safetensors"


def _mtp_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(shard).items() if k.startswith(MTP_PREFIX)})
    if not tensors:
        raise FileNotFoundError(f"no {MTP_PREFIX}* tensors in {directory}")
    return tensors


class MTPTrainer:
    """One MiMo-style MTP layer (index 0) trained against the policy's own next-token distributions.

    Same surface as ``DraftTrainer`` where the online loop uses it (``train_on``,
    ``refresh_target``, ``publishable_state``, ``save``, ``step_count``)."""

    drafter = "mtp"

    def __init__(self, target_dir: Path | str, config: TrainConfig | None = None,
                 start_from: Path | str | None = None):
        from transformers import AutoConfig

        self.config = config or TrainConfig()
        torch.manual_seed(self.config.seed)
        hf = AutoConfig.from_pretrained(target_dir)
        self.eps = float(hf.rms_norm_eps)
        self.layer = MTPLayer(hf).float()
        self.layer.load_checkpoint_tensors(_mtp_tensors(Path(start_from or target_dir)))
        self.refresh_target(target_dir)
        self.bf16 = resolve_mixed_precision(self.config.mixed_precision, on_cpu=True) == "bf16"  # trains on the CPU
        self.optimizer = torch.optim.AdamW(self.layer.parameters(), lr=self.config.lr,
                                           weight_decay=self.config.weight_decay)
        self.step_count = 0

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Path | str, target_dir: Path | str,
                        config: TrainConfig | None = None) -> MTPTrainer:
        trainer = cls(target_dir, config, start_from=checkpoint_dir)
        state = Path(checkpoint_dir) / TRAINER_STATE
        if state.exists():
            saved = torch.load(state, map_location="cpu", weights_only=True)
            trainer.optimizer.load_state_dict(saved["optimizer"])
            trainer.step_count = int(saved["step"])
        return trainer

    def refresh_target(self, target_dir: Path | str) -> None:
        """Embeddings, final norm and LM head of the policy now serving (shared with the MTP layer)."""
        target_dir = Path(target_dir)
        self.embed = target_embedding(target_dir).float()
        self.head = target_lm_head(target_dir).float()
        self.norm = target_final_norm(target_dir).float()

    # -- examples ----------------------------------------------------------------------------
    def _policy_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The policy's next-token logprobs from the states the MTP drafter reads (pre-norm)."""
        h = hidden.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        return (h @ self.head.T).log_softmax(-1)

    def train_on(self, sequences: list[dict[str, Any]]) -> dict[str, float]:
        """One optimizer step of soft cross-entropy over the sequences' drafting rows, at each of
        ``ttt_steps`` chained draft positions (weighted ``decay**j``, normalised by the weights)."""
        self.layer.train()
        k = max(1, self.config.ttt_steps)
        sums: list[list[torch.Tensor]] = [[] for _ in range(k)]
        counts, accept = [0] * k, 0.0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            for seq in sequences:
                first = int(seq.get("first_draft", 0))
                with torch.no_grad(), torch.autocast("cpu", enabled=False):  # the target in fp32, once per row
                    policy_from_first = self._policy_logprobs(seq["final_hidden"][first:]).exp()
                for j, (out, rows) in enumerate(self._chain(seq, k)):
                    if len(rows) == 0:
                        continue
                    mtp = (out @ self.head.T).float().log_softmax(-1)
                    policy = policy_from_first[rows + j + 1 - first]
                    sums[j].append(-(policy * mtp).sum())
                    counts[j] += len(rows)
                    if j == 0:
                        accept += float(torch.minimum(policy, mtp.detach().exp()).sum())
        if not counts[0]:
            return {"loss": float("nan"), "accept_pos0": float("nan"), "rows": 0, "step": self.step_count}
        weights = [self.config.decay ** j for j in range(k) if counts[j]]
        terms = [torch.stack(sums[j]).sum() / counts[j] for j in range(k) if counts[j]]
        loss = sum(w * t for w, t in zip(weights, terms)) / sum(weights)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        lr = scheduled_lr(self.config, self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.config.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.layer.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.step_count += 1
        return {"loss": loss.item(), "accept_pos0": accept / counts[0], "rows": counts[0], "step": self.step_count,
                "lr": lr, **{f"loss_pos{j}": float(t.detach()) for j, t in enumerate(terms)}}

    def _chain(self, seq: dict[str, Any], k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft position j < k: (the MTP layer's outputs [R, H], base rows [R]) when it drafts
        from base s with positions < j accepted, teacher-forced from the rollout (differentiable).

        Position j at base s reads (its output at position j - 1, embedding of token s + j) at
        position start + s + j and attends to the committed rows <= s and to its own chain: all
        bases of a position in one masked pass over the rows of positions 0..j."""
        hidden, nxt = seq["final_hidden"].float(), seq["next_token_ids"]
        n = len(nxt)
        known = nxt >= 0
        embeds = self.embed[nxt.clamp(min=0)]
        base = int(seq.get("start", 0)) + torch.arange(n)
        first = int(seq.get("first_draft", 0))
        t = torch.arange(n)
        causal = t[None, :] <= t[:, None]
        same_base = torch.eye(n, dtype=torch.bool)
        inputs_h, inputs_e, positions, outs, result = [hidden], [embeds], [base], [], []
        for j in range(k):
            if j == 0:
                out = self.layer(hidden[None], embeds[None], base[None])[0]
            else:
                inputs_h.append(outs[-1])
                inputs_e.append(embeds[(t + j).clamp(max=n - 1)])
                positions.append(base + j)
                m = len(inputs_h)  # row blocks: position 0 (committed rows), then chain positions 1..j
                mask = torch.zeros(m * n, m * n, dtype=torch.bool)
                for a in range(m):
                    mask[a * n:(a + 1) * n, :n] = causal
                    for b in range(1, a + 1):
                        mask[a * n:(a + 1) * n, b * n:(b + 1) * n] = same_base
                out = self.layer(torch.cat(inputs_h)[None], torch.cat(inputs_e)[None], torch.cat(positions)[None],
                                 attention_mask=mask[None, None])[0, j * n:]
            outs.append(out)
            rows = torch.arange(first, max(first, n - 1 - j))
            for d in range(j + 2):  # the tokens after rows s .. s + j + 1 must all be known
                rows = rows[known[rows + d]]
            result.append((out[rows], rows))
        return result

    @torch.no_grad()
    def chain_logprobs(self, seq: dict[str, Any], k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft position j < k: (the MTP layer's logprobs [R, V], base rows [R]) as ``_chain``."""
        return [((out.float() @ self.head.T).log_softmax(-1), rows) for out, rows in self._chain(seq, k)]

    @torch.no_grad()
    def estimate_served(self, sequences: list[dict[str, Any]], probabilistic: bool = True,
                        k: int = 1) -> dict[str, Any]:
        """vLLM's expected counters (per position, ``k`` positions) for these rollouts of the policy.

        ``probabilistic``: the engine drafts by sampling (``draft_sample_method``), so the emitted
        token x was an accepted draft with weight min(1, q(x) / p(x)); greedy drafting accepts
        exactly when x is the MTP layer's argmax. p(x) is the engine's own logprob of x."""
        self.layer.eval()
        parts = []
        for seq in sequences:
            n = len(seq["next_token_ids"])
            valid, weights = [], []
            for j, (mtp, rows) in enumerate(self.chain_logprobs(seq, k)):
                emitted = seq["next_token_ids"][rows + j + 1]
                weight = torch.zeros(1, n)
                if probabilistic:
                    p = seq["logprobs"][rows + j + 1].float()
                    weight[0, rows] = (mtp.gather(-1, emitted[:, None])[:, 0] - p).exp().clamp(max=1.0)
                else:
                    weight[0, rows] = (mtp.argmax(-1) == emitted).float()
                drafted = torch.zeros(1, n, dtype=torch.bool)
                drafted[0, rows] = True
                valid.append(drafted)
                weights.append(weight)
            first = torch.tensor([int(seq.get("first_draft", 0))])
            parts.append(served_acceptance(StepAcceptance(valid, weights), first))
        return pool(parts)

    @property
    def drafter_module(self) -> torch.nn.Module:
        """The module whose weights a publish sends (the publish gate swaps them to compare drafts)."""
        return self.layer

    def held_out_acceptance(self, sequences: list[dict[str, Any]]) -> float:
        """vLLM's expected acceptance length at one draft position (what this layer is trained for)."""
        return float(self.estimate_served(sequences, k=1)["acceptance_length"])

    # -- publishing and checkpoints -------------------------------------------------------------
    def publishable_state(self) -> dict[str, torch.Tensor]:
        """The MTP layer under the checkpoint's names, as ``update_draft`` takes it."""
        return self.layer.checkpoint_tensors(0)

    def save(self, out_dir: Path | str, extra: dict | None = None) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.publishable_state().items()}, str(out / MTP_WEIGHTS))
        torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step_count}, out / TRAINER_STATE)
        meta = {"step": self.step_count, "drafter": "mtp", "config": asdict(self.config), **(extra or {})}
        (out / TRAINER_META).write_text(json.dumps(meta, indent=2) + "\n")
        return out
