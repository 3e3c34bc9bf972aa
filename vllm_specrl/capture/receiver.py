"""The trainer's side of capture: a ZeroMQ PULL socket and per-request sequence assembly.

The receiver binds (the engine connects), so either side can restart.
Malformed or foreign frames are rejected and counted, never raised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_specrl.capture.protocol import FrameError, decode_frame


class CaptureReceiver:
    def __init__(self, address: str, rcv_hwm: int = 256):
        import zmq

        self._zmq = zmq
        self.socket = zmq.Context.instance().socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, rcv_hwm)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.counters = {"frames": 0, "rejected": 0, "bytes": 0}
        self.last_error: str | None = None

    def receive(self, timeout_ms: int = 100, max_frames: int = 1024) -> list[tuple[dict, dict[str, torch.Tensor]]]:
        out = []
        if not self.socket.poll(timeout_ms):
            return out
        while len(out) < max_frames:
            try:
                parts = self.socket.recv_multipart(flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                break
            self.counters["bytes"] += sum(len(p) for p in parts)
            try:
                out.append(decode_frame(parts))
                self.counters["frames"] += 1
            except FrameError as exc:
                self.counters["rejected"] += 1
                self.last_error = str(exc)
        return out

    def close(self) -> None:
        self.socket.close(0)


@dataclass
class RequestRows:
    """Rows of one request, keyed by position (a re-sent position overwrites)."""

    policy_versions: set = field(default_factory=set)
    rows: dict[int, tuple[int, int, torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)

    def add(self, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.policy_versions.add(header.get("policy_version"))
        logprobs = tensors.get("logprobs")
        for j, pos in enumerate(header["positions"]):
            logprob = float(logprobs[j]) if logprobs is not None else float("nan")
            old = self.rows.get(pos)
            if old is not None and math.isnan(logprob) and header["next_token_ids"][j] in (old[1], -1):
                # A preempted request's recomputed rows carry no logprob (and a chunk's last row no
                # next token yet): keep the sampled one.
                logprob = old[4]
            self.rows[pos] = (header["token_ids"][j], header["next_token_ids"][j],
                              tensors["aux_hidden"][j], tensors["final_hidden"][j], logprob)

    def contiguous_prefix(self) -> int:
        n = 0
        while n in self.rows:
            n += 1
        return n

    def sequence(self) -> dict[str, torch.Tensor]:
        """The contiguous rows from position 0 as training features (token_ids, aux, final)."""
        n = self.contiguous_prefix()
        rows = [self.rows[p] for p in range(n)]
        # A chunked prefill's last row does not know its successor; the next chunk does.
        nxt = [r[1] if r[1] != -1 or j + 1 >= n else rows[j + 1][0] for j, r in enumerate(rows)]
        return {"token_ids": torch.tensor([r[0] for r in rows], dtype=torch.long),
                "next_token_ids": torch.tensor(nxt, dtype=torch.long),
                "aux_hidden": torch.stack([r[2] for r in rows]) if rows else torch.empty(0),
                "final_hidden": torch.stack([r[3] for r in rows]) if rows else torch.empty(0),
                "logprobs": torch.tensor([r[4] for r in rows], dtype=torch.float32)}


class SequenceAssembler:
    def __init__(self) -> None:
        self.requests: dict[str, RequestRows] = {}

    def add(self, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.requests.setdefault(header["request_id"], RequestRows()).add(header, tensors)

    def pop(self, request_id: str) -> dict[str, torch.Tensor]:
        return self.requests.pop(request_id).sequence()
