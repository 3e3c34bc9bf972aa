"""Turn one engine step's rows into capture frames: committed rows only, copied now.

Row semantics (vLLM V1's runner): request i owns rows
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
from dataclasses import dataclass
from typing import Any

import torch

from vllm_specrl.adaptive.calibration_ids import is_calibration_request
from vllm_specrl.capture.host_staging import StagingPool, stages
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
    """``x.topk(k, dim=-1)`` (values exact, largest first), cheaper than it on a CPU.

    The top-k of a row lies in the k blocks of ``block`` columns with the largest maxima (a block
    outside them has k maxima at least its own above it, so it holds nothing above the k-th value),
    so one cheap ``amax`` pass leaves ``k * block`` candidates for the real top-k instead of the whole
    vocabulary (49152 -> 4096 at a 49k vocabulary). Rows narrower than
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
    whole step: batched rather than per request, as they sit in the engine's critical path
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


@dataclass
class StepCapture:
    """One step's captured rows: what must be read now is copied (hidden states, the scored logit
    rows), and ``frames()`` does the rest (log-softmax, top-k, one frame per request) wherever it runs.
    On a CPU engine that is the capture sender's thread, off the cores the forward runs on: scoring
    and assembly cost several times the copies (``bench_capture.py --tap-only``)."""

    headers: list[dict[str, Any]]  # per request, in row order
    counts: list[tuple[int, int]]  # per request: committed rows n, first row with a sampled next token
    final: torch.Tensor
    aux: torch.Tensor | None
    topk: int
    scored: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
    to_score: tuple[torch.Tensor, list[int], bool] | None = None  # (rows, tokens, rows are log-softmaxed)

    def __len__(self) -> int:
        return len(self.headers)

    def frames(self) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        scored = self.scored
        if scored is None and self.to_score is not None:
            rows, tokens, normalised = self.to_score
            scored = sampled_logprobs(rows, list(range(len(tokens))), tokens, self.topk,
                                      rows if normalised else None)
        frames = []
        offset = row = 0
        for header, (n, first) in zip(self.headers, self.counts):
            tensors = {"final_hidden": self.final[offset:offset + n]}
            if self.aux is not None:
                tensors["aux_hidden"] = self.aux[offset:offset + n]
            if first < n and scored is not None:
                chosen, top_values, top_ids = scored
                m = n - first
                logprobs = torch.full((n,), float("nan"))
                logprobs[first:] = chosen[row:row + m]
                tensors["logprobs"] = logprobs
                if self.topk:
                    tensors["topk_logprobs"] = torch.full((n, self.topk), float("nan"))
                    tensors["topk_ids"] = torch.full((n, self.topk), -1, dtype=torch.int32)
                    tensors["topk_logprobs"][first:] = top_values[row:row + m]
                    tensors["topk_ids"][first:] = top_ids[row:row + m]
                row += m
            frames.append((header, tensors))
            offset += n
        return frames


def committed_rows(req: dict[str, Any], scored: bool) -> tuple[int, int]:
    """``(n, first)``: the request's committed rows this step (a verify step's ``x_last`` and accepted drafts;
    a prefill chunk's every row) and the first of them whose next token was sampled (every committed verify
    row; of a prefill chunk only the last, the rest being followed by prompt tokens), ``n`` when the step
    is not ``scored`` or sampled nothing."""
    span, sampled = req["end"] - req["start"], req["sampled"]
    n = min(len(sampled), span) if req["num_spec"] else span
    first = (0 if req["num_spec"] else n - 1) if scored and sampled else n
    return n, first


def _header(req: dict[str, Any], view: dict[str, Any]) -> dict[str, Any]:
    header = {"request_id": req["request_id"], "drafter": view.get("drafter", "eagle3")}
    if "num_prompt_tokens" in req:
        header["num_prompt_tokens"] = req["num_prompt_tokens"]
    return header


def collect_step(view: dict[str, Any], fraction: float = 1.0, dtype: torch.dtype = torch.bfloat16,
                 topk: int = 0, defer_scoring: bool = False) -> StepCapture | None:
    """The step's part of capture: the committed rows of every selected request, copied. The hidden
    states are copied in one batched call; the sampled tokens' logprobs and the top-k are scored now
    (one softmax, one top-k for the step), or with ``defer_scoring`` only the logit rows they need are
    copied and ``frames()`` scores them later. None when no request has a committed row."""
    ids = view["input_ids"].tolist()
    positions = view["positions"].tolist()
    logits = view.get("logits")
    headers, counts, rows, scored_rows, scored_tokens = [], [], [], [], []
    for req in view["requests"]:
        if not selected(req["request_id"], fraction):
            continue
        start, end, sampled = req["start"], req["end"], req["sampled"]
        n, first = committed_rows(req, logits is not None)
        if n <= 0:
            continue
        nxt = sampled[:n] if req["num_spec"] else ids[start + 1:end] + [sampled[0] if sampled else -1]
        header = {**_header(req, view), "positions": positions[start:start + n], "token_ids": ids[start:start + n],
                  "next_token_ids": nxt}
        headers.append(header)
        counts.append((n, first))
        rows.extend(range(start, start + n))
        scored_rows.extend(req["logit_row"] + j for j in range(n - first))
        scored_tokens.extend(nxt[first:n])
    if not headers:
        return None
    rows_t = torch.tensor(rows, device=view["final_hidden"].device)
    final = view["final_hidden"].index_select(0, rows_t).to("cpu", dtype)
    aux = (torch.cat([h.index_select(0, rows_t) for h in view["aux_hidden"]], dim=-1).to("cpu", dtype)
           if view["aux_hidden"] else None)
    capture = StepCapture(headers, counts, final, aux, topk)
    if scored_rows:
        raw = view.get("raw_logprobs")
        if defer_scoring:
            source = logits if raw is None else raw
            capture.to_score = (source.index_select(0, torch.tensor(scored_rows, device=source.device)).cpu(),
                                scored_tokens, raw is not None)
        else:
            capture.scored = sampled_logprobs(logits, scored_rows, scored_tokens, topk, raw)
    return capture


@dataclass
class StagedStepCapture:
    """One step's committed rows on their way from a GPU: what the step knew on the host (which rows,
    their sampled tokens) and the staged device copies (``capture.host_staging``). ``frames()`` runs in
    the sender's thread: it waits for the copies, builds the headers and frames as ``StepCapture`` does,
    and hands the pinned buffers back."""

    headers: list[dict[str, Any]]   # request ids now; tokens and positions once the copies land
    plan: list[tuple[int, int, int, list[int]]]   # per request: rows n, first scored row, num_spec, sampled
    staged: Any                     # host_staging.StagedCopies
    topk: int

    def __len__(self) -> int:
        return len(self.headers)

    def frames(self) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        try:
            got = {name: t.clone() for name, t in self.staged.wait().items()}   # buffers are reused
        finally:
            self.staged.release()
        ids, positions, next_ids = got["ids"].tolist(), got["positions"].tolist(), got["next_ids"].tolist()
        offset = 0
        for header, (n, _, num_spec, sampled) in zip(self.headers, self.plan):
            header["positions"] = positions[offset:offset + n]
            header["token_ids"] = ids[offset:offset + n]
            header["next_token_ids"] = (sampled[:n] if num_spec else
                                        next_ids[offset:offset + n - 1] + [sampled[0] if sampled else -1])
            offset += n
        scored = (got["chosen"], got.get("top_values"), got.get("top_ids")) if "chosen" in got else None
        capture = StepCapture(self.headers, [(n, first) for n, first, _, _ in self.plan], got["final"],
                              got.get("aux"), self.topk, scored=scored)
        return capture.frames()


def collect_staged_step(view: dict[str, Any], staging: Any, fraction: float = 1.0,
                        dtype: torch.dtype = torch.bfloat16, topk: int = 0) -> StagedStepCapture | None:
    """``collect_step`` for rows on a GPU, without a device synchronisation: the rows are gathered and
    scored on the device (a log-softmax and a top-k of the sampled rows) and staged to pinned host memory
    (``staging``: a ``host_staging.StagingPool``); only host-side facts (the requests' row spans and
    sampled tokens) are read now. None when no request has a committed row or no buffer is free."""
    logits = view.get("logits")
    headers, plan, rows, scored_rows, scored_tokens = [], [], [], [], []
    for req in view["requests"]:
        if not selected(req["request_id"], fraction):
            continue
        start, sampled = req["start"], req["sampled"]
        n, first = committed_rows(req, logits is not None)
        if n <= 0:
            continue
        headers.append(_header(req, view))
        plan.append((n, first, req["num_spec"], list(sampled)))
        rows.extend(range(start, start + n))
        scored_rows.extend(req["logit_row"] + j for j in range(n - first))
        if first < n:   # a verify step's sampled tokens, or a prefill chunk's first sample
            scored_tokens.extend(sampled[first:n] if req["num_spec"] else [sampled[0]])
    if not headers:
        return None
    final = view["final_hidden"]
    device = final.device
    rows_t = staging.ops.to_device(rows, device)
    last = int(view["input_ids"].shape[0]) - 1
    gathered = {"final": final.index_select(0, rows_t).to(dtype),
                "ids": view["input_ids"].index_select(0, rows_t),
                "positions": view["positions"].index_select(0, rows_t),
                "next_ids": view["input_ids"].index_select(0, (rows_t + 1).clamp(max=last))}
    if view["aux_hidden"]:
        gathered["aux"] = torch.cat([h.index_select(0, rows_t) for h in view["aux_hidden"]], dim=-1).to(dtype)
    if scored_rows:
        raw = view.get("raw_logprobs")
        source = logits if raw is None else raw
        picked = source.index_select(0, staging.ops.to_device(scored_rows, device))
        logp = picked.float().log_softmax(-1) if raw is None else picked
        gathered["chosen"] = logp.gather(-1, staging.ops.to_device(scored_tokens, device)[:, None])[:, 0]
        if topk:
            values, indices = logp.topk(topk, dim=-1)
            gathered["top_values"], gathered["top_ids"] = values, indices.to(torch.int32)
    staged = staging.stage(gathered)
    return StagedStepCapture(headers, plan, staged, topk) if staged is not None else None


def step_frames(view: dict[str, Any], fraction: float = 1.0, dtype: torch.dtype = torch.bfloat16,
                topk: int = 0, defer_scoring: bool = False) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """One frame per selected request; every frame's tensors are row slices of the step's batched copies."""
    capture = collect_step(view, fraction, dtype, topk, defer_scoring)
    return capture.frames() if capture is not None else []


class CaptureTap:
    """What the worker installs: collects each step's rows and offers them to the sender, which
    builds the frames in its own thread when that thread runs off the worker's cores."""

    def __init__(self, sender: CaptureSender, fraction: float, policy_version: Any,
                 dtype: torch.dtype = torch.bfloat16, topk: int = 0, staging: Any = None):
        self.sender = sender
        # Rows on a GPU go through pinned buffers and an event (``host_staging``), made at the first such
        # step; a sender process reads the step in this process, so it keeps the copy at once.
        self.staging = staging
        self.fraction = fraction
        self.topk = topk
        self.policy_version = policy_version  # zero-arg callable
        self.dtype = dtype
        self.steps = 0
        self.steps_scored_by_sampler = 0  # steps whose logprobs came from the step's sampler's log-softmax
        self.steps_scored_by_sender = 0   # steps whose scoring ran in the sender thread

    def scores_in_sender(self, view: dict[str, Any]) -> bool:
        """Score in the sender where that saves the forward's cores something: logits on the CPU, the
        sender on CPUs of its own, and either a process of its own (one torch thread) or a thread whose
        torch pool (a new thread inherits the worker's) is no wider than those CPUs. Elsewhere (a GPU's
        logits, a wide CPU worker's thread sender) the step scores as before."""
        logits = view.get("logits")
        return (logits is not None and logits.device.type == "cpu" and bool(self.sender.cpus)
                and (getattr(self.sender, "own_process", False) or torch.get_num_threads() <= len(self.sender.cpus)))

    def __call__(self, view: dict[str, Any]) -> None:
        self.steps += 1
        self.steps_scored_by_sampler += view.get("raw_logprobs") is not None
        if stages(view["final_hidden"]) and not getattr(self.sender, "own_process", False):
            if self.staging is None:
                self.staging = StagingPool()
            capture: Any = collect_staged_step(view, self.staging, self.fraction, self.dtype, self.topk)
        else:
            capture = collect_step(view, self.fraction, self.dtype, self.topk,
                                   defer_scoring=self.scores_in_sender(view))
            if capture is not None:
                self.steps_scored_by_sender += capture.to_score is not None
        if capture is None:
            return
        version = self.policy_version()
        for header in capture.headers:
            header.update(policy_version=version, step=self.steps)
        self.sender.offer_step(capture)
