"""The capture wire format, version 1: one ZeroMQ multipart message per request per step.

Part 0 is a UTF-8 JSON header; parts 1..n are the raw little-endian bytes of
the tensors the header lists, in order. No pickle anywhere.

Header::

    {"magic": "specrl-capture", "version": 1,
     "request_id": str, "policy_version": int, "step": int,
     "positions": [p0, p1, ...],          # absolute positions of the rows
     "token_ids": [t0, t1, ...],          # input token at each position
     "next_token_ids": [n0, n1, ...],     # token committed at position + 1 (-1: not known yet)
     "tensors": [{"name": "aux_hidden", "dtype": "bfloat16", "shape": [n, 3H]},
                 {"name": "final_hidden", "dtype": "bfloat16", "shape": [n, H]},
                 {"name": "logprobs", "dtype": "float32", "shape": [n]},            # optional
                 {"name": "topk_logprobs", "dtype": "float32", "shape": [n, K]},    # optional
                 {"name": "topk_ids", "dtype": "int32", "shape": [n, K]}]}          # optional

``aux_hidden`` is the concatenation of the EAGLE-3 layers' residual streams
(vLLM's ``aux_hidden_states``, pre-norm); ``final_hidden`` is the target's
post-norm last hidden state, from which the trainer computes the target's
distribution with the LM head. ``logprobs[j]`` is the target's logprob of
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


def decode_frame(parts: list[bytes]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
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
    n = len(header.get("positions", []))
    if len(header.get("token_ids", [])) != n or len(header.get("next_token_ids", [])) != n:
        raise FrameError("positions, token_ids and next_token_ids differ in length")
    tensors = {}
    for spec, buf in zip(specs, parts[1:]):
        dtype = DTYPES.get(spec.get("dtype"))
        shape = spec.get("shape")
        if dtype is None or not isinstance(shape, list):
            raise FrameError(f"bad tensor spec {spec!r}")
        numel = 1
        for d in shape:
            numel *= int(d)
        if numel * torch.tensor([], dtype=dtype).element_size() != len(buf):
            raise FrameError(f"tensor {spec.get('name')!r}: {len(buf)} bytes for shape {shape} {spec['dtype']}")
        if shape and shape[0] != n:
            raise FrameError(f"tensor {spec.get('name')!r} has {shape[0]} rows for {n} positions")
        raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        tensors[spec["name"]] = raw.view(dtype).reshape(shape)
    return header, tensors
