"""The draft-training core shared by the offline warm start and the online trainer.

One ``DraftTrainer`` owns the draft, its AdamW optimizer and an accelerate
``Accelerator``, and trains in fp32 or under bf16 autocast (``mixed_precision``);
``step`` takes a batch of target features (tokens, aux hidden states, final hidden states) and does one
optimizer step of the EAGLE-3 loss; ``save``/``load`` checkpoint the draft in
its serving format plus the optimizer state, so training resumes where it
stopped and vLLM can load the same directory.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

from vllm_specrl.proposer.checkpoint import load_draft, save_draft, target_embedding, target_lm_head
from vllm_specrl.proposer.eagle3_torch import Eagle3Draft
from vllm_specrl.trainer.acceptance import StepAcceptance
from vllm_specrl.trainer.loss import LossConfig, TargetRows, eagle3_loss, valid_mask
from vllm_specrl.trainer.placement import place

TRAINER_STATE = "trainer_state.pt"
TRAINER_META = "trainer_meta.json"


@dataclass
class TrainConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    # Decoupled decay toward the weights the trainer started from instead of toward zero (L2-SP): each
    # step moves every trainable weight lr * start_anchor of the way back to its start, so a fine-tuned
    # draft stays near the one it started from (on a fresh build it cost acceptance: docs/eagle3.md).
    start_anchor: float = 0.0
    # Training only: Gaussian noise added to the target's hidden-state features, this many times
    # each channel's standard deviation in the batch (EAGLE's feature noise: the draft learns to
    # tolerate the error its own chained states carry, and overfits a small rollout set less).
    feature_noise: float = 0.0
    ttt_steps: int = 3
    decay: float = 0.8
    tv_weight: float = 0.0           # weight of the TV(p, q) term (1 - acceptance at T=1)
    accept_weighted: bool = False    # weight step k by P(vLLM reaches it) (see trainer.loss)
    grad_clip: float = 1.0
    mixed_precision: str = "no"  # "no" (fp32), "bf16" (autocast) or "auto" (``resolve_mixed_precision``)
    seed: int = 0
    # "constant" (the online trainer: it never ends) or "cosine": linear warm-up over
    # ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps`` (a warm
    # start of known length ends at a lower loss for the same steps).
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.1
    device: str = "auto"  # where the trainer runs (``placement.resolve_device``: auto, cpu, cuda, cuda:N)


def resolve_mixed_precision(value: str, on_cpu: bool = False) -> str:
    """``"auto"``: bf16 autocast where matrix multiplies run natively in bf16 (a CUDA device that
    supports it; a CPU with AVX512-BF16 or AMX, where a draft training step runs faster than
    in fp32), fp32 elsewhere (emulated bf16 on an AVX2 CPU is slower than fp32). ``on_cpu``: for a
    trainer that stays on the CPU whatever devices the machine has."""
    if value not in ("no", "bf16", "auto"):
        raise ValueError(f"mixed_precision must be 'no', 'bf16' or 'auto', not {value!r}")
    if value != "auto":
        return value
    if torch.cuda.is_available() and not on_cpu:
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    native = [getattr(torch.cpu, name, lambda: False)() for name in
              ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return "bf16" if any(native) else "no"


def resolve_serving_dtype(value: str) -> str:
    """A vLLM dtype; ``"auto"``: bfloat16 where this machine multiplies bf16 natively
    (``resolve_mixed_precision("auto")``), float32 elsewhere. The demo serves with this choice, and
    a draft built for it trains on hidden states captured at the same dtype."""
    if value != "auto":
        return value
    return "bfloat16" if resolve_mixed_precision("auto") == "bf16" else "float32"


def scheduled_lr(config: TrainConfig, step: int) -> float:
    """The learning rate for the ``step``-th update (0-based) under ``config``'s schedule."""
    if config.lr_schedule == "constant":
        return config.lr
    if config.lr_schedule != "cosine":
        raise ValueError(f"lr_schedule must be 'constant' or 'cosine', not {config.lr_schedule!r}")
    if config.total_steps <= 0:
        raise ValueError("the cosine schedule needs total_steps > 0")
    warm = min(1.0, (step + 1) / config.warmup_steps) if config.warmup_steps else 1.0
    progress = min(1.0, step / config.total_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.lr * warm * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


@dataclass
class Batch:
    """Target features for a batch of sequences (padded to T).

    ``first`` is the first base position vLLM drafts from (prompt length - 1): the loss and
    every metric count only positions from there on. The target's distributions come from
    ``final_hidden`` through the LM head (``target_lse`` caches its logsumexp per row) or, from
    capture, from the engine's top-K logprobs (``topk_*``) and the sampled tokens' ``logprobs``.
    """

    token_ids: torch.Tensor      # [B, T] long
    aux_hidden: torch.Tensor     # [B, T, n_aux * H]
    final_hidden: torch.Tensor | None   # [B, T, H] post-norm
    lengths: torch.Tensor        # [B] long
    first: torch.Tensor          # [B] long
    target_lse: torch.Tensor | None = None      # [B, T]
    topk_logprobs: torch.Tensor | None = None   # [B, T, K]
    topk_ids: torch.Tensor | None = None        # [B, T, K]
    logprobs: torch.Tensor | None = None        # [B, T]

    def target_rows(self, device: torch.device | str = "cpu") -> TargetRows:
        def dev(x):
            return None if x is None else x.to(device)
        return TargetRows(self.token_ids.to(device), dev(self.final_hidden), dev(self.target_lse),
                          dev(self.topk_logprobs), dev(self.topk_ids), dev(self.logprobs))


def _pad(sequences: list[dict[str, torch.Tensor]], key: str, t: int, fill: float,
         dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    if any(key not in s for s in sequences):
        return None
    first = sequences[0][key]
    out = torch.full((len(sequences), t, *first.shape[1:]), fill, dtype=dtype)
    for i, s in enumerate(sequences):
        out[i, : len(s[key])] = s[key].to(dtype)
    return out


def collate(sequences: list[dict[str, torch.Tensor]]) -> Batch:
    """Pad per-sequence features into a Batch.

    Each sequence has ``token_ids``, ``aux_hidden`` and either ``final_hidden`` (optionally
    ``target_lse``) or ``topk_logprobs``/``topk_ids``/``logprobs``, and ``first_draft`` (the
    prompt length - 1; 0 when absent, i.e. every position is a completion position).
    """
    lengths = torch.tensor([len(s["token_ids"]) for s in sequences])
    t = int(lengths.max())
    topk = all("topk_logprobs" in s for s in sequences)
    return Batch(
        token_ids=_pad(sequences, "token_ids", t, 0, torch.long),
        aux_hidden=_pad(sequences, "aux_hidden", t, 0.0),
        final_hidden=None if topk else _pad(sequences, "final_hidden", t, 0.0),
        lengths=lengths,
        first=torch.tensor([int(s.get("first_draft", 0)) for s in sequences]),
        target_lse=None if topk else _pad(sequences, "target_lse", t, 0.0),
        topk_logprobs=_pad(sequences, "topk_logprobs", t, float("nan")) if topk else None,
        topk_ids=_pad(sequences, "topk_ids", t, -1, torch.long) if topk else None,
        logprobs=_pad(sequences, "logprobs", t, float("nan")) if topk else None,
    )


def with_feature_noise(aux_hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """``aux_hidden`` [B, T, C] plus Gaussian noise of ``scale`` times each channel's standard
    deviation over the batch's rows, padding included (per channel: a target's hidden states carry a
    few channels far larger than the rest, which a single scale would let drown the others)."""
    std = aux_hidden.float().reshape(-1, aux_hidden.shape[-1]).std(dim=0)
    noise = torch.randn(aux_hidden.shape, dtype=torch.float32, device=aux_hidden.device) * (scale * std)
    return (aux_hidden.float() + noise).to(aux_hidden.dtype)


class DraftTrainer:
    drafter = "eagle3"  # the capture frames it learns from (``MTPTrainer`` takes "mtp" ones)

    def __init__(self, draft: Eagle3Draft, target_head: torch.Tensor | None, config: TrainConfig | None = None):
        self.config = config or TrainConfig()
        torch.manual_seed(self.config.seed)
        self.mixed_precision = resolve_mixed_precision(self.config.mixed_precision)
        # Autocast is applied in ``step``, not through Accelerate, whose precision is fixed once per
        # process: a process may hold trainers at different precisions (tests, resumed runs).
        device = place(self.config.device)
        self.accelerator = Accelerator(cpu=device == "cpu")
        if str(self.accelerator.device) != device:
            raise ValueError(f"the trainer was placed on {device}, but this process's Accelerate state was set "
                             f"up on {self.accelerator.device} already (one device per process)")
        params = [p for n, p in draft.named_parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=self.config.weight_decay)
        self.draft, self.optimizer = self.accelerator.prepare(draft, opt)
        # (weight, its starting value) for every trained weight, when the steps pull toward the start.
        self._start = ([(p, p.detach().clone()) for g in self.optimizer.param_groups for p in g["params"]]
                       if self.config.start_anchor else None)
        self.set_target_head(target_head)
        self.step_count = 0
        self.schedule_origin = 0   # the step the schedule counts from (a resumed run restarts it)

    def set_target_head(self, target_head: torch.Tensor | None) -> None:
        """The target's LM head the soft targets come from with hidden-state features (None when
        every batch carries the engine's top-K logprobs instead)."""
        self.target_head = None if target_head is None else target_head.float().to(self.accelerator.device)

    @classmethod
    def from_checkpoint(cls, draft_dir: Path | str, target_dir: Path | str,
                        config: TrainConfig | None = None) -> DraftTrainer:
        """Resume from ``draft_dir`` (weights, and optimizer state if present)."""
        trainer = cls(load_draft(draft_dir, target_dir), target_lm_head(Path(target_dir)), config)
        state = Path(draft_dir) / TRAINER_STATE
        if state.exists():
            saved = torch.load(state, map_location="cpu", weights_only=True)
            trainer.optimizer.load_state_dict(saved["optimizer"])
            trainer.step_count = trainer.schedule_origin = int(saved["step"])
        return trainer

    def refresh_target(self, target_dir: Path | str) -> None:
        """Take the LM head and embedding of the policy now serving (after a policy update)."""
        self.set_target_head(target_lm_head(Path(target_dir)))
        with torch.no_grad():
            self.unwrapped.embed_tokens.weight.copy_(target_embedding(Path(target_dir)))

    def train_on(self, sequences: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        return self.step(collate(sequences))

    def publishable_state(self) -> dict[str, torch.Tensor]:
        """The draft as ``update_draft`` takes it (its serving checkpoint's tensors)."""
        return {k: v.detach().cpu() for k, v in self.unwrapped.checkpoint_state_dict().items()}

    @property
    def unwrapped(self) -> Eagle3Draft:
        return self.accelerator.unwrap_model(self.draft)

    @property
    def drafter_module(self) -> torch.nn.Module:
        """The module whose weights a publish sends (the publish gate swaps them to compare drafts)."""
        return self.unwrapped

    def held_out_acceptance(self, sequences: list[dict[str, torch.Tensor]]) -> float:
        """vLLM's expected acceptance length for this draft on rollouts it was not trained on."""
        return float(self.evaluate_many(sequences)["served_acceptance_length"])

    @property
    def loss_config(self) -> LossConfig:
        c = self.config
        return LossConfig(decay=c.decay, tv_weight=c.tv_weight, accept_weighted=c.accept_weighted)

    def _unroll(self, batch: Batch, noisy: bool = False) -> list[torch.Tensor]:
        dev = self.accelerator.device
        lengths, first = batch.lengths.to(dev), batch.first.to(dev)
        masks = [valid_mask(lengths, batch.token_ids.shape[1], k, first) for k in range(self.config.ttt_steps)]
        aux = batch.aux_hidden.to(dev)
        if noisy and self.config.feature_noise > 0:
            aux = with_feature_noise(aux, self.config.feature_noise)
        return self.unwrapped.unroll(aux, batch.token_ids.to(dev), self.config.ttt_steps, logits_masks=masks)

    def _loss(self, batch: Batch, with_metrics: bool, served: bool = False, noisy: bool = False):
        dev = self.accelerator.device
        lengths, first = batch.lengths.to(dev), batch.first.to(dev)
        logits = self._unroll(batch, noisy)
        return eagle3_loss(logits, batch.target_rows(dev), self.target_head,
                           self.unwrapped.draft_token_ids(), lengths, first,
                           self.loss_config, with_metrics=with_metrics, served=served)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.mixed_precision == "bf16":
            return torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self, batch: Batch) -> dict[str, float]:
        draft = self.draft
        draft.train()
        with self._autocast():
            out = self._loss(batch, with_metrics=True, noisy=True)
        self.optimizer.zero_grad(set_to_none=True)
        self.accelerator.backward(out.loss)
        lr = scheduled_lr(self.config, self.step_count - self.schedule_origin)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.config.grad_clip:
            self.accelerator.clip_grad_norm_(draft.parameters(), self.config.grad_clip)
        self.optimizer.step()
        if self._start is not None:
            self._pull_to_start(min(1.0, lr * self.config.start_anchor))
        self.step_count += 1
        return dict(out.metrics, step=self.step_count, lr=lr)

    @torch.no_grad()
    def _pull_to_start(self, fraction: float) -> None:
        for p, start in self._start:
            p.lerp_(start, fraction)

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> dict[str, float]:
        """Loss and metrics, including the expected vLLM counters (``served_*``)."""
        self.draft.eval()
        return self._loss(batch, with_metrics=True, served=True).metrics

    @torch.no_grad()
    def acceptance(self, batch: Batch) -> StepAcceptance:
        """Per draft start and step, whether vLLM drafts there and the chance the step is accepted given
        the emitted token (``trainer.acceptance``): for estimates that mix this draft with another source."""
        self.draft.eval()
        return self._loss(batch, with_metrics=False, served=True).acceptance

    @torch.no_grad()
    def draft_logits(self, batch: Batch) -> list[torch.Tensor]:
        """The draft's logits [B, T, draft vocab] per TTT step, teacher-forced on the batch's tokens (rows no
        draft start reads stay 0): the distributions it would draft from wherever its earlier steps were
        accepted, for estimates of rules that read the draft's confidence."""
        self.draft.eval()
        return self._unroll(batch)

    def evaluate_many(self, sequences: list[dict[str, torch.Tensor]], batch_size: int = 16) -> dict[str, float]:
        """``evaluate`` over many sequences, the served estimate pooled exactly across batches."""
        from vllm_specrl.trainer.acceptance import pool

        parts, metrics = [], []
        for i in range(0, len(sequences), batch_size):
            m = self.evaluate(collate(sequences[i:i + batch_size]))
            metrics.append(m)
            if "served_drafts" in m:
                parts.append({"drafts": m["served_drafts"], "accepted_per_pos": m["served_accepted"]})
        out = {k: sum(m[k] for m in metrics) / len(metrics) for k in metrics[0]
               if isinstance(metrics[0][k], float) and not k.startswith("served")}
        if parts:
            est = pool(parts)
            out.update({f"served_accept_pos{k}": v for k, v in enumerate(est["per_position"])})
            out["served_acceptance_length"] = est["acceptance_length"]
            out["served_drafts"] = est["drafts"]
        return out

    def save(self, out_dir: Path | str, extra: dict | None = None) -> Path:
        """Draft (servable) + optimizer state + metadata, replacing ``out_dir`` atomically."""
        out = save_draft(self.unwrapped, out_dir)
        torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step_count},
                   out / TRAINER_STATE)
        meta = {"step": self.step_count, "config": asdict(self.config), **(extra or {})}
        (out / TRAINER_META).write_text(json.dumps(meta, indent=2) + "\n")
        return out
