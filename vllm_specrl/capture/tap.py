"""Turn one engine step's rows into capture frames: committed rows only, copied now.

Row semantics (vLLM V1, map section 2.7): request i owns rows
``[start, end)``; for a request verifying k drafts the rows are
``[x_last, d_1..d_k]`` and only the first ``len(sampled)`` (the accepted drafts
plus ``x_last``) are committed context; prefill rows are all committed. The
token committed after row j is ``sampled[j]`` for verify rows, the next
prompt token for prefill rows, and unknown (-1) at the end of a partial
prefill chunk. At a length or stop limit the engine may trim accepted tokens
from the output after verification; their rows are still sent (they are the
target's true states for a sampled prefix). Everything is copied before returning: the runner reuses its
buffers next step. Logprobs of sampled tokens come from the logits vLLM computed for
this step (no second LM-head pass); the rows of a verify step's logits are the
request's committed rows in order, a prefill chunk has one (its last row).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from vllm_specrl.adaptive.calibrate import is_calibration_request
from vllm_specrl.capture.sender import CaptureSender


def selected(request_id: str, fraction: float) -> bool:
    """Stable per-request sampling: a request is captured whole or not at all. Never the synthetic
    requests of an adaptive-k calibration sweep: a draft must not learn from them."""
    if is_calibration_request(request_id):
        return False
    if fraction >= 1.0:
        return True
    return (zlib.crc32(request_id.encode()) % 10_000) < fraction * 10_000


def sampled_logprobs(logits: torch.Tensor, first_row: int, tokens: list[int], topk: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Logprobs (T=1, before any sampling parameter: vLLM's ``raw_logprobs``) of the tokens sampled
    from logit rows ``first_row ..``, and the target's top-k there."""
    logp = logits[first_row:first_row + len(tokens)].float().log_softmax(-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].cpu()
    if not topk:
        return chosen, None, None
    values, indices = logp.topk(topk, dim=-1)
    return chosen, values.cpu(), indices.to(torch.int32).cpu()


def step_frames(view: dict[str, Any], fraction: float = 1.0, dtype: torch.dtype = torch.bfloat16,
                topk: int = 0) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    ids = view["input_ids"].tolist()
    positions = view["positions"].tolist()
    logits = view.get("logits")
    frames = []
    aux_all = None
    for req in view["requests"]:
        if not selected(req["request_id"], fraction):
            continue
        start, end, sampled = req["start"], req["end"], req["sampled"]
        if req["num_spec"]:
            n = min(len(sampled), end - start)
            nxt = sampled[:n]
        else:
            n = end - start
            nxt = ids[start + 1:end] + [sampled[0] if sampled else -1]
        if n <= 0:
            continue
        if aux_all is None and view["aux_hidden"]:
            aux_all = torch.cat(view["aux_hidden"], dim=-1)
        rows = slice(start, start + n)
        header = {"request_id": req["request_id"], "positions": positions[rows],
                  "token_ids": ids[rows], "next_token_ids": nxt, "drafter": view.get("drafter", "eagle3")}
        if "num_prompt_tokens" in req:
            header["num_prompt_tokens"] = req["num_prompt_tokens"]
        tensors = {"final_hidden": view["final_hidden"][rows].to("cpu", dtype, copy=True)}
        if aux_all is not None:
            tensors["aux_hidden"] = aux_all[rows].to("cpu", dtype, copy=True)
        if logits is not None and sampled:
            # Rows whose next token was sampled: every committed verify row; of a prefill chunk
            # only the last (the rest are followed by prompt tokens: NaN).
            first = 0 if req["num_spec"] else n - 1
            chosen, top_values, top_ids = sampled_logprobs(logits, req["logit_row"], nxt[first:n], topk)
            logprobs = torch.full((n,), float("nan"))
            logprobs[first:] = chosen
            tensors["logprobs"] = logprobs
            if topk:
                tensors["topk_logprobs"] = torch.full((n, topk), float("nan"))
                tensors["topk_ids"] = torch.full((n, topk), -1, dtype=torch.int32)
                tensors["topk_logprobs"][first:] = top_values
                tensors["topk_ids"][first:] = top_ids
        frames.append((header, tensors))
    return frames


class CaptureTap:
    """What the worker installs: builds frames each step and offers them to the sender."""

    def __init__(self, sender: CaptureSender, fraction: float, policy_version: Any,
                 dtype: torch.dtype = torch.bfloat16, topk: int = 0):
        self.sender = sender
        self.fraction = fraction
        self.topk = topk
        self.policy_version = policy_version  # zero-arg callable
        self.dtype = dtype
        self.steps = 0

    def __call__(self, view: dict[str, Any]) -> None:
        self.steps += 1
        version = self.policy_version()
        for header, tensors in step_frames(view, self.fraction, self.dtype, self.topk):
            header.update(policy_version=version, step=self.steps)
            self.sender.offer(header, tensors)
