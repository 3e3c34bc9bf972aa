"""The capture wire format, version 1: one ZeroMQ multipart message per request per step.

Part 0 is a UTF-8 JSON header; parts 1..n are the raw little-endian bytes of
the tensors the header lists, in order. No pickle anywhere.

Header::

    {"magic": "specrl-capture", "version": 1,
     "request_id": str, "policy_version": int, "step": int,
     "positions": [p0, p1, ...],          # absolute positions of the rows
     "token_ids": [t0, t1, ...],          # input token at each position
     "next_token_ids": [n0, n1, ...],     # token committed at position + 1 (-1: not known yet)
     "drafter": "eagle3" | "mtp",         # what the engine drafts with (absent: eagle3)
     "tensors": [{"name": "aux_hidden", "dtype": "bfloat16", "shape": [n, 3H]},
                 {"name": "final_hidden", "dtype": "bfloat16", "shape": [n, H]},
                 {"name": "logprobs", "dtype": "float32", "shape": [n]},            # optional
                 {"name": "topk_logprobs", "dtype": "float32", "shape": [n, K]},    # optional
                 {"name": "topk_ids", "dtype": "int32", "shape": [n, K]}]}          # optional

``aux_hidden`` is the concatenation of the EAGLE-3 layers' residual streams
(vLLM's ``aux_hidden_states``, pre-norm); ``final_hidden`` is the target's
post-norm last hidden state, from which the trainer computes the target's
distribution with the LM head. An engine that drafts with the policy's own MTP
layers (``"drafter": "mtp"``) sends no ``aux_hidden``, and its ``final_hidden``
is the state it hands the MTP drafter (for MiMo the last layer's output before
the final norm). ``logprobs[j]`` is the target's logprob of
``next_token_ids[j]`` where that token was sampled (T=1 and before sampling
parameters, vLLM's ``raw_logprobs``; NaN where the next token is a prompt
token), and ``topk_*`` the target's top K there (``capture_topk`` in the
config; absent when 0). Only committed rows are sent (rows of rejected drafts
never are).
"""

from __future__ import annotations

import json
from typing import Any

import torch

MAGIC = "specrl-capture"
VERSION = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64, "int32": torch.int32}
MAX_HEADER_BYTES = 1 << 20


class FrameError(ValueError):
    """A malformed or foreign frame (the receiver counts and drops it)."""


def encode_frame(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[bytes]:
    specs, parts = [], []
    for name, tensor in tensors.items():
        t = tensor.detach().contiguous().cpu()
        dtype = str(t.dtype).removeprefix("torch.")
        specs.append({"name": name, "dtype": dtype, "shape": list(t.shape)})
        parts.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    head = dict(header, magic=MAGIC, version=VERSION, tensors=specs)
    return [json.dumps(head).encode()] + parts


# What each kind of drafter's engine sends (the header's "drafter"; absent means eagle3).
REQUIRED_TENSORS = {"eagle3": ("aux_hidden", "final_hidden"), "mtp": ("final_hidden",)}
MAX_DIM = 1 << 31


def _int_list(header: dict, key: str) -> list[int]:
    value = header.get(key)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise FrameError(f"{key} must be a list of integers")
    return value


def decode_frame(parts: list[bytes]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Header and tensors of one frame; anything malformed raises ``FrameError`` (and only that),
    so a foreign or corrupted sender can never crash the receiver or the assembler."""
    try:
        return _decode(parts)
    except FrameError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a fuzzed frame trips on is a refusal
        raise FrameError(f"malformed frame: {type(exc).__name__}: {exc}") from None


def _decode(parts: list[bytes]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if not parts or len(parts[0]) > MAX_HEADER_BYTES:
        raise FrameError("empty frame or oversized header")
    try:
        header = json.loads(parts[0].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise FrameError("not a specrl-capture frame")
    if header.get("version") != VERSION:
        raise FrameError(f"unsupported capture protocol version {header.get('version')!r}")
    specs = header.get("tensors")
    if not isinstance(specs, list) or len(specs) != len(parts) - 1:
        raise FrameError(f"header lists {len(specs) if isinstance(specs, list) else '?'} tensors, "
                         f"frame has {len(parts) - 1} buffers")
    if not isinstance(header.get("request_id"), str):
        raise FrameError("request_id must be a string")
    for key in ("policy_version", "step", "num_prompt_tokens"):
        value = header.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise FrameError(f"{key} must be an integer")
    positions = _int_list(header, "positions")
    n = len(positions)
    if len(_int_list(header, "token_ids")) != n or len(_int_list(header, "next_token_ids")) != n:
        raise FrameError("positions, token_ids and next_token_ids differ in length")
    if any(p < 0 for p in positions):
        raise FrameError("negative position")
    tensors = {}
    for spec, buf in zip(specs, parts[1:]):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise FrameError(f"bad tensor spec {spec!r}")
        dtype = DTYPES.get(spec.get("dtype"))
        shape = spec.get("shape")
        if dtype is None or not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_DIM for d in shape):
            raise FrameError(f"bad tensor spec {spec!r}")
        numel = 1
        for d in shape:
            numel *= int(d)
        if numel * torch.tensor([], dtype=dtype).element_size() != len(buf):
            raise FrameError(f"tensor {spec.get('name')!r}: {len(buf)} bytes for shape {shape} {spec['dtype']}")
        if not shape or shape[0] != n:
            raise FrameError(f"tensor {spec.get('name')!r} has shape {shape} for {n} positions")
        raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        tensors[spec["name"]] = raw.view(dtype).reshape(shape)
    drafter = header.get("drafter", "eagle3")
    if drafter not in REQUIRED_TENSORS:
        raise FrameError(f"drafter must be one of {sorted(REQUIRED_TENSORS)}")
    for name in REQUIRED_TENSORS[drafter]:
        if name not in tensors or tensors[name].dim() != 2:
            raise FrameError(f"frame lacks a [rows, hidden] {name!r} tensor")
    if "logprobs" in tensors and tensors["logprobs"].dim() != 1:
        raise FrameError("logprobs must be [rows]")
    top = [tensors.get("topk_logprobs"), tensors.get("topk_ids")]
    if any(t is not None for t in top) and (any(t is None or t.dim() != 2 for t in top)
                                            or top[0].shape != top[1].shape or top[0].shape[1] < 1):
        raise FrameError("topk_logprobs and topk_ids must both be [rows, K]")
    return header, tensors
