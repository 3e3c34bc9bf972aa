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


TOPK_BLOCK = 64


def exact_topk(x: torch.Tensor, k: int, block: int = TOPK_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` (values exact, largest first) in about 60% of its time on a CPU.

    The top-k of a row lies in the k blocks of ``block`` columns with the largest maxima (a block
    outside them has k maxima at least its own above it, so it holds nothing above the k-th value),
    so one cheap ``amax`` pass leaves ``k * block`` candidates for the real top-k instead of the whole
    vocabulary (49152 -> 4096 for SmolLM2: 4.2 -> 2.7 ms for 48 rows on one core). Rows narrower than
    that, or not a whole number of blocks, take ``torch.topk``."""
    rows, width = x.shape
    blocks = width // block
    if blocks * block != width or blocks <= k:
        return x.topk(k, dim=-1)
    tiled = x.view(rows, blocks, block)
    top_blocks = tiled.amax(-1).topk(k, dim=-1).indices
    candidates = tiled.gather(1, top_blocks[:, :, None].expand(rows, k, block)).view(rows, k * block)
    values, where = candidates.topk(k, dim=-1)
    return values, top_blocks.gather(1, where // block) * block + where % block


def sampled_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], topk: int,
                     raw_logprobs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Logprobs (T=1, before any sampling parameter: vLLM's ``raw_logprobs``) of the tokens sampled
    from logit rows ``rows``, and the target's top-k there: one softmax and one top-k for the
    whole step. Per request, with top-64, they cost 5.5-8.3 ms of a 100-130 ms step at 16 sequences
    on one core (2-3 committed rows each), in the engine's critical path; batched, 3.9-5.7 ms
    (``bench_capture.py --tap-only``). ``raw_logprobs``: the step's log-softmax of ``logits`` when a
    sampler took one already (float32, same rows), read instead of a second one."""
    source = logits if raw_logprobs is None else raw_logprobs
    if rows == list(range(rows[0], rows[0] + len(rows))):  # every draft accepted: no copy
        picked = source[rows[0]:rows[0] + len(rows)]
    else:
        picked = source.index_select(0, torch.tensor(rows, device=source.device))
    logp = picked.float().log_softmax(-1) if raw_logprobs is None else picked
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].cpu()
    if not topk:
        return chosen, None, None
    values, indices = exact_topk(logp, topk)
    return chosen, values.cpu(), indices.to(torch.int32).cpu()


def step_frames(view: dict[str, Any], fraction: float = 1.0, dtype: torch.dtype = torch.bfloat16,
                topk: int = 0) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """One frame per selected request. The step's committed rows are copied (hidden states) and
    scored (logprobs, top-k) in one batched call each; every frame's tensors are row slices of them."""
    ids = view["input_ids"].tolist()
    positions = view["positions"].tolist()
    logits = view.get("logits")
    plans = []  # (request, first committed row, rows, next tokens, first row with a sampled next token)
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
        # Rows whose next token was sampled: every committed verify row; of a prefill chunk only the
        # last (the rest are followed by prompt tokens: NaN).
        first = 0 if req["num_spec"] else n - 1
        plans.append((req, start, n, nxt, first if logits is not None and sampled else n))
    if not plans:
        return []
    rows = torch.tensor([r for _, start, n, _, _ in plans for r in range(start, start + n)],
                        device=view["final_hidden"].device)
    final = view["final_hidden"].index_select(0, rows).to("cpu", dtype)
    aux = (torch.cat([h.index_select(0, rows) for h in view["aux_hidden"]], dim=-1).to("cpu", dtype)
           if view["aux_hidden"] else None)
    scored_rows = [req["logit_row"] + j for req, _, n, _, first in plans for j in range(n - first)]
    if scored_rows:
        chosen, top_values, top_ids = sampled_logprobs(
            logits, scored_rows, [t for _, _, n, nxt, first in plans for t in nxt[first:n]], topk,
            view.get("raw_logprobs"))
    frames = []
    offset = scored = 0
    for req, start, n, nxt, first in plans:
        header = {"request_id": req["request_id"], "positions": positions[start:start + n],
                  "token_ids": ids[start:start + n], "next_token_ids": nxt, "drafter": view.get("drafter", "eagle3")}
        if "num_prompt_tokens" in req:
            header["num_prompt_tokens"] = req["num_prompt_tokens"]
        tensors = {"final_hidden": final[offset:offset + n]}
        if aux is not None:
            tensors["aux_hidden"] = aux[offset:offset + n]
        if first < n:
            m = n - first
            logprobs = torch.full((n,), float("nan"))
            logprobs[first:] = chosen[scored:scored + m]
            tensors["logprobs"] = logprobs
            if topk:
                tensors["topk_logprobs"] = torch.full((n, topk), float("nan"))
                tensors["topk_ids"] = torch.full((n, topk), -1, dtype=torch.int32)
                tensors["topk_logprobs"][first:] = top_values[scored:scored + m]
                tensors["topk_ids"][first:] = top_ids[scored:scored + m]
            scored += m
        frames.append((header, tensors))
        offset += n
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
        self.steps_scored_by_sampler = 0  # steps whose logprobs came from the step's sampler's log-softmax

    def __call__(self, view: dict[str, Any]) -> None:
        self.steps += 1
        self.steps_scored_by_sampler += view.get("raw_logprobs") is not None
        version = self.policy_version()
        for header, tensors in step_frames(view, self.fraction, self.dtype, self.topk):
            header.update(policy_version=version, step=self.steps)
            self.sender.offer(header, tensors)
