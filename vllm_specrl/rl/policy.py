"""The trainer side of a GRPO loop: an HF policy, its optimizer, logprob recomputation, the loss."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def grpo_advantages(rewards: list[float], group: int) -> torch.Tensor:
    """Group-normalised advantages: (r - mean of its group) / (std of its group + eps)."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def clipped_policy_gradient_loss(logps: list[torch.Tensor], behaviour_logps: list[list[float]],
                                 advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """PPO-clipped surrogate against the behaviour policy's logprobs, mean per sequence then batch.

    The behaviour policy is whatever produced each token (with policy lag a rollout can
    span two versions), and vLLM reports exactly its logprob, so ``exp(logp - behaviour)``
    corrects both the lag and the engine's numerics per token.
    """
    per_seq = []
    for adv, lp, old in zip(advantages, logps, behaviour_logps):
        ratio = torch.exp(lp - torch.tensor(old, dtype=lp.dtype))
        per_seq.append(torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean())
    return -torch.stack(per_seq).mean()


def length_sorted_chunks(samples: list[dict], micro_batch: int) -> list[list[int]]:
    """Sample indices in micro-batches of similar total length (prompt + completion), shortest first."""
    lengths = [len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples]
    order = sorted(range(len(samples)), key=lengths.__getitem__)
    return [order[start : start + micro_batch] for start in range(0, len(order), micro_batch)]


class Policy:
    """An HF causal LM in float32 with AdamW; ``version`` counts the updates pushed to the engine."""

    def __init__(self, model_dir: Path, lr: float, seed: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.version = 0

    def chat(self, prompt: str) -> str:
        """The prompt as the policy is served it (chat template; plain text for base models)."""
        if not self.tok.chat_template:
            return prompt + "\n"
        return self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)

    def token_logprobs(self, samples: list[dict], micro_batch: int = 4) -> list[torch.Tensor]:
        """Per-sample logprobs of the completion tokens under the current policy (with grad).

        Sequences go through the model in micro-batches of similar length (sorted), each padded
        to its own longest: RL completions vary from a dozen tokens to the cap, and one batch
        padded to the longest spends most of its compute on padding.
        """
        out: list[torch.Tensor | None] = [None] * len(samples)
        for chunk in length_sorted_chunks(samples, micro_batch):
            for i, logp in zip(chunk, self._padded_logprobs([samples[i] for i in chunk])):
                out[i] = logp
        return out

    def _padded_logprobs(self, samples: list[dict]) -> list[torch.Tensor]:
        seqs = [s["prompt_ids"] + s["completion_ids"] for s in samples]
        width = max(len(x) for x in seqs)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        out = []
        for i, s in enumerate(samples):
            start = len(s["prompt_ids"]) - 1
            out.append(logp[i, start : start + len(s["completion_ids"])])
        return out

    def grpo_pass(self, samples: list[dict], group: int, clip: float,
                  micro_batch: int = 4) -> tuple[list[torch.Tensor], float, float, float]:
        """Logprob recomputation and one GRPO step in one pass: each micro-batch's share of the loss
        is back-propagated as soon as its logprobs exist, so one micro-batch's autograd graph is alive
        at a time (the whole step's took ~10 GB at 16 answers of 256 tokens in float32). The same
        gradient as ``grpo_step`` on ``token_logprobs`` (the loss is a mean over sequences). Returns
        the logprobs (detached), the loss, and the seconds spent in forward passes and in the update."""
        advantages = grpo_advantages([s["reward"] for s in samples], group)
        out: list[torch.Tensor | None] = [None] * len(samples)
        loss_total, forward_s, update_s = 0.0, 0.0, 0.0
        self.opt.zero_grad(set_to_none=True)
        for chunk in length_sorted_chunks(samples, micro_batch):
            t0 = time.perf_counter()
            logps = self._padded_logprobs([samples[i] for i in chunk])
            t1 = time.perf_counter()
            share = clipped_policy_gradient_loss(logps, [samples[i]["vllm_logprobs"] for i in chunk],
                                                 advantages[chunk], clip) * (len(chunk) / len(samples))
            share.backward()
            loss_total += float(share.detach())
            for i, logp in zip(chunk, logps):
                out[i] = logp.detach()
            forward_s, update_s = forward_s + t1 - t0, update_s + time.perf_counter() - t1
        t0 = time.perf_counter()
        self._apply_gradients()
        return out, loss_total, forward_s, update_s + time.perf_counter() - t0

    def grpo_step(self, samples: list[dict], logps: list[torch.Tensor], group: int, clip: float) -> float:
        """One optimizer step on the clipped GRPO loss; returns the loss."""
        loss = clipped_policy_gradient_loss(logps, [s["vllm_logprobs"] for s in samples],
                                            grpo_advantages([s["reward"] for s in samples], group), clip)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self._apply_gradients()
        return float(loss.detach())

    def _apply_gradients(self) -> None:
        """The update every GRPO step ends with: gradients clipped to norm 1, one AdamW step."""
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def write_head(self, checkpoint_dir: Path, out: Path) -> None:
        """What ``train-draft --mtp`` reads of the current policy (embedding, final norm, an untied LM head)
        with its config, written to ``out`` before each policy update: a few hundred MB less to write per
        step than the whole checkpoint."""
        import shutil

        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        if not (out / "config.json").exists():  # the shapes never change; the tensors do, every step
            shutil.copy(checkpoint_dir / "config.json", out / "config.json")
        params = dict(self.model.named_parameters())
        keep = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
        save_file({k: params[k].detach().contiguous() for k in keep if k in params}, out / "model.safetensors")
