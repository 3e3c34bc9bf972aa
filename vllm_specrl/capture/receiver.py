"""The trainer's side of capture: a ZeroMQ PULL socket and per-request sequence assembly.

The receiver binds (the engine connects), so either side can restart.
Malformed or foreign frames are rejected and counted, never raised.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from vllm_specrl.capture.protocol import FrameError, decode_frame
from vllm_specrl.security import require_local_zmq_address


class CaptureReceiver:
    """A PULL socket for captured frames.

    With ``background`` a thread of its own owns the socket and keeps taking frames into a buffer
    of up to ``max_buffered`` while the caller is busy (an online trainer's training step can take
    seconds at idle priority, and frames that wait in ZeroMQ's queues past their high-water marks
    are dropped at the sender): ``receive`` then hands out what the thread took. A full buffer
    stops the thread's reading, so the sender drops and counts (``frames_dropped_peer_busy``);
    memory stays bounded.

    ``counters`` (frames, rejected, bytes) change only in ``receive``: a background receiver keeps
    its thread's counts aside and adds them there, so reports read between two receives agree.
    """

    def __init__(self, address: str, rcv_hwm: int = 256, allow_remote: bool = False,
                 background: bool = False, max_buffered: int = 8192):
        """Binds ``address``; a non-loopback one (hidden states from anywhere) only with ``allow_remote``."""
        import zmq

        require_local_zmq_address(address, allow_remote, "capture receiver", "pass --capture-allow-remote")

        self._zmq = zmq
        self.socket = zmq.Context.instance().socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, rcv_hwm)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.counters = {"frames": 0, "rejected": 0, "bytes": 0}
        self._counted_by_thread = dict.fromkeys(self.counters, 0)
        self.last_error: str | None = None
        self.max_buffered = max_buffered
        self._buffer: deque = deque()
        self._ready = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="specrl-capture-receiver", daemon=True)
            self._thread.start()

    def receive(self, timeout_ms: int = 100, max_frames: int = 1024) -> list[tuple[dict, dict[str, torch.Tensor]]]:
        """Up to ``max_frames`` frames, waiting up to ``timeout_ms`` for the first."""
        if self._thread is None:
            return self._take(timeout_ms, max_frames)
        with self._ready:
            if not self._buffer:
                self._ready.wait(timeout_ms / 1000)
            out = [self._buffer.popleft() for _ in range(min(max_frames, len(self._buffer)))]
            for key, count in self._counted_by_thread.items():
                self.counters[key] += count
                self._counted_by_thread[key] = 0
            self._ready.notify_all()  # room again for the reading thread
        return out

    def pending(self, timeout_ms: int = 0) -> bool:
        """Frames waiting to be received (in the socket, or in the background buffer), waiting up to
        ``timeout_ms`` for one: how a caller tells a quiet stream."""
        if self._thread is None:
            return bool(self.socket.poll(timeout_ms))
        with self._ready:
            if not self._buffer:
                self._ready.wait(timeout_ms / 1000)
            return bool(self._buffer)

    def _take(self, timeout_ms: int, max_frames: int,
              counters: dict[str, int] | None = None) -> list[tuple[dict, dict[str, torch.Tensor]]]:
        counters = self.counters if counters is None else counters
        out = []
        if not self.socket.poll(timeout_ms):
            return out
        while len(out) < max_frames:
            try:
                parts = self.socket.recv_multipart(flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                break
            counters["bytes"] += sum(len(p) for p in parts)
            try:
                out.append(decode_frame(parts))
                counters["frames"] += 1
            except FrameError as exc:
                counters["rejected"] += 1
                self.last_error = str(exc)
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._ready:
                while len(self._buffer) >= self.max_buffered and not self._stop.is_set():
                    self._ready.wait(0.1)
                room = self.max_buffered - len(self._buffer)
            counted = dict.fromkeys(self.counters, 0)
            try:
                frames = self._take(100, max(room, 1), counted)
            except Exception as exc:  # noqa: BLE001 - the reading thread outlives a bad read
                frames = []
                counted["rejected"] += 1
                self.last_error = repr(exc)
                self._stop.wait(0.1)
            with self._ready:
                for key, count in counted.items():
                    self._counted_by_thread[key] += count
                if frames:
                    self._buffer.extend(frames)
                    self._ready.notify_all()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            with self._ready:
                self._ready.notify_all()
            self._thread.join(timeout=2.0)
        self.socket.close(0)


@dataclass
class RequestRows:
    """Rows of one request, keyed by position (a re-sent position overwrites).

    Each row remembers the policy version its hidden states came from and the one its
    target (sampled logprob, top-K) came from: a request recomputed after a commit has
    new hidden states but keeps the targets sampled under the old policy.
    """

    policy_versions: set = field(default_factory=set)
    rows: dict[int, tuple[int, int, torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)
    # The engine's top-K logprobs of the target at a row (capture_topk), where it sampled.
    topk: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    hidden_version: dict[int, Any] = field(default_factory=dict)
    target_version: dict[int, Any] = field(default_factory=dict)
    num_prompt_tokens: int | None = None
    drafter: str = "eagle3"  # what the engine drafts with: "mtp" frames carry no aux_hidden

    def add(self, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        version = header.get("policy_version")
        self.policy_versions.add(version)
        if header.get("num_prompt_tokens") is not None:
            self.num_prompt_tokens = int(header["num_prompt_tokens"])
        self.drafter = header.get("drafter", "eagle3")
        aux = tensors.get("aux_hidden")
        logprobs = tensors.get("logprobs")
        top_values, top_ids = tensors.get("topk_logprobs"), tensors.get("topk_ids")
        for j, pos in enumerate(header["positions"]):
            logprob = float(logprobs[j]) if logprobs is not None else float("nan")
            old = self.rows.get(pos)
            if old is not None and math.isnan(logprob) and header["next_token_ids"][j] in (old[1], -1):
                # A preempted request's recomputed rows carry no logprob (and a chunk's last row no
                # next token yet): keep the sampled one (and its top-K, and the version of both).
                logprob = old[4]
            else:
                self.target_version[pos] = version
                if top_values is not None and not math.isnan(float(top_values[j, 0])):
                    self.topk[pos] = (top_values[j], top_ids[j])
            self.hidden_version[pos] = version
            self.rows[pos] = (header["token_ids"][j], header["next_token_ids"][j],
                              None if aux is None else aux[j], tensors["final_hidden"][j], logprob)

    def trainable_run(self, version: Any = None) -> tuple[int, int]:
        """``(start, length)`` of the rows a draft can learn from: the last contiguous run of
        positions whose hidden states and targets both come from ``version`` (any version when
        None). Rows before the first captured position may be missing (they came from the prefix
        cache); completion-only training does not need them."""
        def ok(pos: int) -> bool:
            return pos in self.rows and (version is None or (
                self.hidden_version.get(pos) == version and self.target_version.get(pos) == version))
        positions = [p for p in self.rows if ok(p)]
        if not positions:
            return 0, 0
        end = max(positions)
        start = end
        while ok(start - 1):
            start -= 1
        return start, end - start + 1

    def contiguous_prefix(self) -> int:
        """Rows from position 0 without a gap (0 when the prompt's start came from the cache)."""
        n = 0
        while n in self.rows:
            n += 1
        return n

    def sequence(self, version: Any = None) -> dict[str, Any]:
        """The rows of ``trainable_run(version)`` as training features.

        token_ids, next_token_ids, aux_hidden (absent for an MTP engine's rows, see ``drafter``),
        final_hidden, logprobs (of each row's successor,
        NaN where it was not sampled), ``start`` (the first row's position), ``first_draft``
        (prompt length - 1 - start, at least 0: the first row vLLM drafts from) and, when every
        sampled row carries them, ``topk_logprobs``/``topk_ids``. Attention in the draft is
        rotary (relative), so a run that starts after 0 needs no position offset.
        """
        start, n = self.trainable_run(version)
        span = range(start, start + n)
        rows = [self.rows[p] for p in span]
        # A chunked prefill's last row does not know its successor; the next chunk does.
        nxt = [r[1] if r[1] != -1 or j + 1 >= n else rows[j + 1][0] for j, r in enumerate(rows)]
        out: dict[str, Any] = {
            "token_ids": torch.tensor([r[0] for r in rows], dtype=torch.long),
            "next_token_ids": torch.tensor(nxt, dtype=torch.long),
            "final_hidden": torch.stack([r[3] for r in rows]) if rows else torch.empty(0),
            "logprobs": torch.tensor([r[4] for r in rows], dtype=torch.float32),
            "start": start,
            "first_draft": max((self.num_prompt_tokens or 1) - 1 - start, 0)}
        if all(r[2] is not None for r in rows):
            out["aux_hidden"] = torch.stack([r[2] for r in rows]) if rows else torch.empty(0)
        sampled = [p for p in span if p - start >= out["first_draft"]]
        if self.topk and sampled and all(p in self.topk for p in sampled):
            k = self.topk[sampled[0]][0].shape[0]
            values = torch.full((n, k), float("nan"))
            ids = torch.full((n, k), -1, dtype=torch.int32)
            for p in sampled:
                values[p - start], ids[p - start] = self.topk[p]
            out["topk_logprobs"], out["topk_ids"] = values, ids
        return out


class SequenceAssembler:
    def __init__(self) -> None:
        self.requests: dict[str, RequestRows] = {}

    def add(self, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.requests.setdefault(header["request_id"], RequestRows()).add(header, tensors)

    def pop(self, request_id: str, version: Any = None) -> dict[str, Any]:
        """A finished request's trainable rows (``RequestRows.sequence``)."""
        return self.requests.pop(request_id).sequence(version)


def receive_while(address: str, send: Callable[[], Any], wanted: int, timeout_s: float = 30.0,
                  settle_s: float = 1.0) -> tuple[Any, list[dict[str, Any]]]:
    """Listen on ``address``, call ``send()`` (which makes the engine generate) once ``settle_s`` gave
    the engine's sender time to connect, then gather captured sequences until ``wanted`` requests are
    whole and the stream is quiet (or ``timeout_s``): ``send``'s result and every request's sequence."""
    import time

    receiver, assembler = CaptureReceiver(address), SequenceAssembler()
    try:
        time.sleep(settle_s)
        result = send()
        deadline = time.time() + timeout_s
        while time.time() < deadline and (len(assembler.requests) < wanted or receiver.pending(1000)):
            for header, tensors in receiver.receive(200):
                assembler.add(header, tensors)
    finally:
        receiver.close()
    return result, [assembler.pop(rid) for rid in list(assembler.requests)]
