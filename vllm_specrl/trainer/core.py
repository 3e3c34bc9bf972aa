"""The draft-training core shared by the offline warm start and the online trainer.

One ``DraftTrainer`` owns the draft, its AdamW optimizer and an accelerate
``Accelerator`` (fp32 or bf16 autocast); ``step`` takes a batch of target
features (tokens, aux hidden states, final hidden states) and does one
optimizer step of the EAGLE-3 loss; ``save``/``load`` checkpoint the draft in
its serving format plus the optimizer state, so training resumes where it
stopped and vLLM can load the same directory.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

from vllm_specrl.proposer.checkpoint import load_draft, save_draft, target_lm_head
from vllm_specrl.proposer.eagle3_torch import Eagle3Draft
from vllm_specrl.trainer.loss import eagle3_loss

TRAINER_STATE = "trainer_state.pt"
TRAINER_META = "trainer_meta.json"


@dataclass
class TrainConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    ttt_steps: int = 3
    decay: float = 0.8
    grad_clip: float = 1.0
    mixed_precision: str = "no"  # "no" (fp32) or "bf16"
    seed: int = 0


@dataclass
class Batch:
    """Target features for a batch of sequences (padded to T)."""

    token_ids: torch.Tensor      # [B, T] long
    aux_hidden: torch.Tensor     # [B, T, n_aux * H]
    final_hidden: torch.Tensor   # [B, T, H] post-norm
    lengths: torch.Tensor        # [B] long


def collate(sequences: list[dict[str, torch.Tensor]]) -> Batch:
    """Pad per-sequence features ({token_ids, aux_hidden, final_hidden}) into a Batch."""
    lengths = torch.tensor([len(s["token_ids"]) for s in sequences])
    t = int(lengths.max())
    b = len(sequences)
    aux_dim = sequences[0]["aux_hidden"].shape[-1]
    hid_dim = sequences[0]["final_hidden"].shape[-1]
    tokens = torch.zeros(b, t, dtype=torch.long)
    aux = torch.zeros(b, t, aux_dim)
    final = torch.zeros(b, t, hid_dim)
    for i, s in enumerate(sequences):
        n = len(s["token_ids"])
        tokens[i, :n] = s["token_ids"]
        aux[i, :n] = s["aux_hidden"].float()
        final[i, :n] = s["final_hidden"].float()
    return Batch(tokens, aux, final, lengths)


class DraftTrainer:
    def __init__(self, draft: Eagle3Draft, target_head: torch.Tensor, config: TrainConfig | None = None):
        self.config = config or TrainConfig()
        torch.manual_seed(self.config.seed)
        self.accelerator = Accelerator(mixed_precision=self.config.mixed_precision, cpu=not torch.cuda.is_available())
        params = [p for n, p in draft.named_parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=self.config.weight_decay)
        self.draft, self.optimizer = self.accelerator.prepare(draft, opt)
        self.set_target_head(target_head)
        self.step_count = 0

    def set_target_head(self, target_head: torch.Tensor) -> None:
        """The target's LM head the soft targets come from (replaced when the policy moves)."""
        self.target_head = target_head.float().to(self.accelerator.device)

    @classmethod
    def from_checkpoint(cls, draft_dir: Path | str, target_dir: Path | str,
                        config: TrainConfig | None = None) -> DraftTrainer:
        """Resume from ``draft_dir`` (weights, and optimizer state if present)."""
        trainer = cls(load_draft(draft_dir, target_dir), target_lm_head(Path(target_dir)), config)
        state = Path(draft_dir) / TRAINER_STATE
        if state.exists():
            saved = torch.load(state, map_location="cpu", weights_only=True)
            trainer.optimizer.load_state_dict(saved["optimizer"])
            trainer.step_count = int(saved["step"])
        return trainer

    @property
    def unwrapped(self) -> Eagle3Draft:
        return self.accelerator.unwrap_model(self.draft)

    def step(self, batch: Batch) -> dict[str, float]:
        draft = self.draft
        draft.train()
        dev = self.accelerator.device
        with self.accelerator.autocast():
            logits = self.unwrapped.unroll(batch.aux_hidden.to(dev), batch.token_ids.to(dev),
                                           self.config.ttt_steps)
            out = eagle3_loss(logits, batch.final_hidden.to(dev), self.target_head,
                              self.unwrapped.draft_token_ids(), batch.lengths.to(dev),
                              decay=self.config.decay)
        self.optimizer.zero_grad(set_to_none=True)
        self.accelerator.backward(out.loss)
        if self.config.grad_clip:
            self.accelerator.clip_grad_norm_(draft.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.step_count += 1
        return dict(out.metrics, step=self.step_count)

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> dict[str, float]:
        self.draft.eval()
        dev = self.accelerator.device
        logits = self.unwrapped.unroll(batch.aux_hidden.to(dev), batch.token_ids.to(dev),
                                       self.config.ttt_steps)
        out = eagle3_loss(logits, batch.final_hidden.to(dev), self.target_head,
                          self.unwrapped.draft_token_ids(), batch.lengths.to(dev),
                          decay=self.config.decay)
        return out.metrics

    def save(self, out_dir: Path | str, extra: dict | None = None) -> Path:
        """Draft (servable) + optimizer state + metadata, replacing ``out_dir`` atomically."""
        out = save_draft(self.unwrapped, out_dir)
        torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step_count},
                   out / TRAINER_STATE)
        meta = {"step": self.step_count, "config": asdict(self.config), **(extra or {})}
        (out / TRAINER_META).write_text(json.dumps(meta, indent=2) + "\n")
        return out
