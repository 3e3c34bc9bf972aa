"""Estimate vs served: what the trainer predicts for rollouts vLLM actually served.

Given the rollouts a speculative engine produced (they are samples of the
target: speculation is lossless), the draft and the target, compute the
trainer's estimates of vLLM's per-position acceptance counters three ways:

- ``served``: completion positions only, averaged over vLLM's draft starts
  (``acceptance.served_acceptance``): what the engine should report;
- ``chained_mean``: per-step mean acceptance over completion positions,
  chained as if steps were independent (the trainer's cheap running metric);
- ``with_prompt_positions``: the served estimate with prompt positions counted
  as completions (what the trainer measured before it was completion-only).

The policy's own MTP layer (``"method": "mtp"``) is estimated the same way by
``MTPTrainer.estimate_served`` (``estimate_mtp_from_rollouts``), from the body's HF
forward: its last layer's output before the norm is the state vLLM's MTP drafter reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from vllm_specrl.proposer.checkpoint import load_draft, target_lm_head
from vllm_specrl.trainer.core import DraftTrainer, TrainConfig
from vllm_specrl.trainer.features import sequence_features
from vllm_specrl.trainer.mtp import MTPTrainer


def estimate_from_rollouts(target_dir: Path | str, draft_dir: Path | str, sequences: list[list[int]],
                           prompt_lengths: list[int], k: int, batch_size: int = 16) -> dict[str, list[float]]:
    """Per-position estimates (lists of length ``k``) for ``sequences`` (prompt + completion ids)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = load_draft(draft_dir, target_dir)
    features = sequence_features(target, sequences, draft.shape.aux_layer_ids, dtype=torch.float32,
                                 prompt_lengths=prompt_lengths)
    del target
    trainer = DraftTrainer(draft, target_lm_head(Path(target_dir)), TrainConfig(ttt_steps=k))
    completion = trainer.evaluate_many(features, batch_size)
    everything = trainer.evaluate_many([dict(f, first_draft=0) for f in features], batch_size)
    chained, chain = [], 1.0
    for j in range(k):
        chain *= completion[f"expected_accept_step{j}"]
        chained.append(chain)
    return {"served": [completion[f"served_accept_pos{j}"] for j in range(k)],
            "served_acceptance_length": completion["served_acceptance_length"],
            "served_drafts": completion["served_drafts"],
            "chained_mean": chained,
            "with_prompt_positions": [everything[f"served_accept_pos{j}"] for j in range(k)]}


@torch.no_grad()
def mtp_features(target_dir: Path | str, sequences: list[list[int]], prompt_lengths: list[int]) -> list[dict]:
    """The features vLLM's capture hands ``MTPTrainer`` for these rollouts, from an HF forward of the
    body: the last layer's output before the norm per row, the next token and its logprob."""
    from transformers import AutoModelForCausalLM

    from vllm_specrl.proposer.mtp_torch import body_features

    body = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    items = []
    for seq, n_prompt in zip(sequences, prompt_lengths):
        ids = torch.tensor([seq])
        hidden, logits = body_features(body, ids)
        logprobs = logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        items.append({"final_hidden": hidden[0, :-1].float(), "next_token_ids": ids[0, 1:],
                      "logprobs": logprobs, "start": 0, "first_draft": max(n_prompt - 1, 0)})
    return items


def estimate_mtp_from_rollouts(target_dir: Path | str, sequences: list[list[int]], prompt_lengths: list[int],
                               k: int) -> dict[str, list[float]]:
    """``estimate_from_rollouts`` for the target's own MTP layer (the ``served`` estimate only)."""
    est = MTPTrainer(target_dir).estimate_served(mtp_features(target_dir, sequences, prompt_lengths), k=k)
    return {"served": list(est["per_position"]), "served_acceptance_length": est["acceptance_length"],
            "served_drafts": est["drafts"]}


def serve_rollouts(target: str | Path, draft: str | Path | None, prompts: list[str], k: int, dtype: str,
                   max_tokens: int, ignore_eos: bool, chat: bool = True, max_num_seqs: int = 16) -> dict:
    """T=1 rollouts from an in-process engine (its own subprocess) serving ``draft`` (None: the
    target's own MTP layer) with k probabilistic drafts: sequences, prompt lengths and vLLM's
    ``spec_decode`` counters."""
    spec = {"num_speculative_tokens": k, "draft_sample_method": "probabilistic",
            **({"method": "mtp"} if draft is None else {"method": "eagle3", "model": str(draft)})}
    code = textwrap.dedent(f"""
        import json
        from vllm import LLM, SamplingParams
        from vllm_specrl import metrics
        llm = LLM(model={str(target)!r}, dtype={dtype!r}, enforce_eager=True, seed=0, max_model_len=1024,
                  max_num_seqs={max_num_seqs}, disable_log_stats=False,
                  speculative_config={spec!r})
        tok = llm.get_tokenizer()
        prompts = {prompts!r}
        if {chat} and tok.chat_template:
            prompts = [tok.apply_chat_template([{{"role": "user", "content": p}}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
        params = [SamplingParams(temperature=1.0, max_tokens={max_tokens}, ignore_eos={ignore_eos}, seed=i)
                  for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        print("RESULT " + json.dumps({{
            "sequences": [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs],
            "prompt_lengths": [len(o.prompt_token_ids) for o in outs],
            "spec_decode": metrics.from_llm_metrics(llm.get_metrics()).summary()}}))
    """)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_PLUGINS="specrl")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError((proc.stdout + proc.stderr)[-4000:])
