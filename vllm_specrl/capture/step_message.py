"""One engine step's capture (``capture.tap.StepCapture``) as a ZeroMQ message, from the worker to its
capture sender process (``capture.sender_process``).

The worker sends the step's copied tensors as they are (zero-copy buffers, one per tensor) behind a
JSON header, so the step does a handful of Python calls however many requests it ran; the sender
process scores the logit rows and builds the per-request frames. Both ends are the same package on
one host, but the receiving end still refuses a malformed message with ``StepMessageError`` alone.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from vllm_specrl.capture.tap import StepCapture

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
           "int32": torch.int32, "int64": torch.int64}


class StepMessageError(ValueError):
    """A message that is not a step capture this version of the package wrote."""


def _tensor_bytes(t: torch.Tensor) -> Any:
    """A buffer over the tensor's bytes, no copy (ZeroMQ keeps the tensor alive until it is sent)."""
    t = t.detach().contiguous()
    return t.view(torch.uint8).numpy() if t.numel() else b""


def encode_step(capture: StepCapture) -> list[Any]:
    """Header JSON, then one buffer per tensor."""
    tensors: dict[str, torch.Tensor] = {"final": capture.final}
    if capture.aux is not None:
        tensors["aux"] = capture.aux
    head: dict[str, Any] = {"headers": capture.headers, "counts": capture.counts, "topk": capture.topk}
    if capture.to_score is not None:
        rows, tokens, normalised = capture.to_score
        tensors["to_score"] = rows
        head.update(tokens=tokens, normalised=normalised)
    if capture.scored is not None:
        for name, t in zip(("chosen", "top_values", "top_ids"), capture.scored):
            if t is not None:
                tensors[name] = t
    head["tensors"] = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
    return [json.dumps(head).encode(), *(_tensor_bytes(t) for t in tensors.values())]


def decode_step(parts: list[Any]) -> StepCapture:
    """The ``StepCapture`` ``encode_step`` sent (its tensors copied out of the message buffers)."""
    try:
        buffers = [p.buffer if hasattr(p, "buffer") else p for p in parts]  # ZeroMQ frames or bytes
        head = json.loads(bytes(buffers[0]))
        specs = head["tensors"]
        if len(specs) != len(buffers) - 1:
            raise StepMessageError(f"{len(specs)} tensors declared, {len(buffers) - 1} sent")
        tensors = {}
        for (name, dtype, shape), buf in zip(specs, buffers[1:]):
            raw = bytearray(buf)
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            tensors[name] = t.view(_DTYPES[dtype]).reshape(shape)
        capture = StepCapture([dict(h) for h in head["headers"]], [tuple(c) for c in head["counts"]],
                              tensors["final"], tensors.get("aux"), int(head["topk"]))
        if "to_score" in tensors:
            capture.to_score = (tensors["to_score"], list(head["tokens"]), bool(head["normalised"]))
        if "chosen" in tensors:
            capture.scored = (tensors["chosen"], tensors.get("top_values"), tensors.get("top_ids"))
        if len(capture.headers) != len(capture.counts):
            raise StepMessageError("headers and counts differ in length")
        return capture
    except StepMessageError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a malformed message trips on is a refusal
        raise StepMessageError(f"malformed step message: {type(exc).__name__}: {exc}") from None
