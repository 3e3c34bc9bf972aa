"""The worker's side of capture: a bounded queue and a ZeroMQ PUSH thread that never blocks the step.

``offer`` is called inside the engine step with already-copied tensors, ``offer_step`` with a step's
copied rows whose frames are built later (``capture.tap.StepCapture``); both only enqueue, and the
queue's bound counts frames. A background thread builds, encodes and sends frames
without blocking (``zmq.NOBLOCK``). A full queue, a slow trainer or no trainer
at all means dropped frames, counted, never a stalled engine.

``trainer_connected`` in ``state()`` is the socket's own view (a ZeroMQ socket monitor's
connect/disconnect events), so an idle replica with a live trainer reads connected and a
replica whose trainer died reads disconnected, whatever the traffic.

The sender thread runs on the CPUs the engine may use but its worker's compute threads are not
bound to (``spare_cpus``: on vLLM's CPU backend the worker binds every thread it starts, this one
included, to its OpenMP cores, and vLLM reserves the rest for the API server and the engine loop),
so encoding and sending frames does not take cycles from the model's forward.

``send_timeout_s`` > 0 lets the *sender thread* wait that long for a slow peer
before dropping a frame (the queue keeps absorbing the engine's frames meanwhile,
so the step still never waits). An offline warm start, which wants every row,
uses it; online serving keeps 0: a frame that cannot go at once is dropped.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Protocol

import torch

from vllm_specrl.capture.protocol import encode_frame
from vllm_specrl.security import require_local_zmq_address

DEFAULT_QUEUE_FRAMES = 256
SEND_HWM = 64


def spare_cpus() -> set[int]:
    """CPUs this process's parent (vLLM's engine core) may run on that the calling thread may not: on
    vLLM's CPU backend, those its worker did not bind to its compute threads. Empty where the worker
    is not bound (GPU workers) or the platform cannot say. CPUs that ``VLLM_CPU_OMP_THREADS_BIND``
    gives any rank are never spare: under tensor or data parallelism on one host the other ranks'
    forwards run there, and a sender placed on them (at ``SCHED_IDLE``) starved while they computed."""
    try:
        spare = os.sched_getaffinity(os.getppid()) - os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set()
    return spare - omp_bound_cpus(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""))


def omp_bound_cpus(mask: str) -> set[int]:
    """Every CPU an explicit ``VLLM_CPU_OMP_THREADS_BIND`` binds ("0-3,8|4-7": ranks split by "|",
    ranges with "-"); none for "auto", "nobind" or unset (vLLM then picks one NUMA node per rank)."""
    if mask in ("", "auto", "nobind"):
        return set()
    cpus: set[int] = set()
    for part in mask.replace("|", ",").split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            cpus.update(range(int(low), int(high or low) + 1))
        except ValueError:
            raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND: cannot read {part!r} in {mask!r}") from None
    return cpus


def resolve_sender_cpus(setting: object) -> set[int]:
    """``capture_sender_cpus``: "auto" (``spare_cpus``), "inherit" (the worker's own), or CPU ids."""
    if setting in (None, "auto"):
        return spare_cpus()
    if setting == "inherit":
        return set()
    if isinstance(setting, list) and setting and all(isinstance(c, int) and c >= 0 for c in setting):
        return set(setting)
    raise ValueError(f'capture_sender_cpus must be "auto", "inherit" or a list of CPU ids, not {setting!r}')


FRAME_DROP_KEYS = ("frames_dropped_queue_full", "frames_dropped_no_peer", "frames_dropped_peer_busy",
                   "frames_dropped_build_error")


def frames_settled(state: dict[str, Any]) -> int:
    """Frames a sender is done with (sent, or dropped and counted), from its ``state()``."""
    return state.get("frames_sent", 0) + sum(state.get(key, 0) for key in FRAME_DROP_KEYS)


def capture_address(address: str, allow_remote: bool) -> str:
    """The trainer's address, refused unless local or ``capture_allow_remote`` (hidden states leave the host)."""
    return require_local_zmq_address(
        address, allow_remote, "capture",
        'set "capture_allow_remote": true in --additional-config \'{"specrl": {...}}\'')


def resolve_sender_kind(setting: object, cpus: set[int]) -> str:
    """``capture_sender``: "process" (``capture.sender_process``: the worker's GIL stays the forward's),
    "thread" (this module's, in the worker), "auto": a process where it has CPUs of its own (a CPU
    engine), a thread elsewhere (a GPU worker's step scores on the device and the thread only sends)."""
    if setting in (None, "auto"):
        return "process" if cpus else "thread"
    if setting in ("process", "thread"):
        return str(setting)
    raise ValueError(f'capture_sender must be "auto", "process" or "thread", not {setting!r}')


def resolve_sender_idle(setting: object, cpus: set[int], send_timeout_s: float) -> bool:
    """``capture_sender_sched``: "idle" runs the sender thread (and ZeroMQ's I/O thread it starts) under
    ``SCHED_IDLE``, "normal" at the worker's priority, "auto" idle where it runs on CPUs of its own and
    drops rather than waits (``send_timeout_s`` 0). On a CPU engine those CPUs are where vLLM's engine
    loop and API server run, which feed the forward: the sender's scoring and encoding must not delay
    them. A sender that waits for its peer (the offline warm start) wants every row, so keeps its share."""
    if setting in (None, "auto"):
        return bool(cpus) and send_timeout_s == 0
    if setting in ("idle", "normal"):
        return setting == "idle"
    raise ValueError(f'capture_sender_sched must be "auto", "idle" or "normal", not {setting!r}')


class PendingFrames(Protocol):
    """A step's frames, built in the sender thread: ``len()`` of them, ``frames()`` to build them."""

    def __len__(self) -> int: ...

    def frames(self) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]: ...


class CaptureSender:
    own_process = False  # a thread of the process that offers (``capture.sender_process`` is the other kind)

    def __init__(self, address: str, queue_frames: int = DEFAULT_QUEUE_FRAMES, allow_remote: bool = False,
                 send_timeout_s: float = 0.0, cpus: set[int] | None = None, idle: bool = False):
        self.address = capture_address(address, allow_remote)
        self._queue: queue.Queue = queue.Queue()  # (frame count, a frame or PendingFrames)
        self.queue_frames = queue_frames
        self._queued = 0  # frames in the queue, under _queued_lock
        self._queued_lock = threading.Lock()
        self.send_timeout_s = send_timeout_s
        self.counters = {"frames_offered": 0, "frames_sent": 0, "frames_dropped_queue_full": 0,
                         "frames_dropped_no_peer": 0, "frames_dropped_peer_busy": 0, "frames_dropped_build_error": 0,
                         "bytes_sent": 0}
        self.last_build_error: str | None = None
        self._peers = 0  # live connections to a trainer, from the socket monitor's events
        self.cpus = sorted(cpus or ())  # where the sender thread runs; empty: where it was started
        self.cpus_error: str | None = None
        self.idle = idle  # SCHED_IDLE (``resolve_sender_idle``)
        self.sched_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specrl-capture", daemon=True)
        self._thread.start()

    def offer(self, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        return self._enqueue(1, (header, tensors))

    def offer_step(self, pending: PendingFrames) -> bool:
        """A step's frames, all or none: built in the sender thread. Refused (and counted as dropped)
        when they would overfill the queue, unless it is empty."""
        return self._enqueue(len(pending), pending)

    def _enqueue(self, count: int, item: Any) -> bool:
        self.counters["frames_offered"] += count
        with self._queued_lock:
            if self._queued and self._queued + count > self.queue_frames:
                self.counters["frames_dropped_queue_full"] += count
                return False
            self._queued += count
        self._queue.put_nowait((count, item))
        return True

    def _frames_of(self, count: int, item: Any) -> list:
        if isinstance(item, tuple):
            return [item]
        try:
            return item.frames()
        except Exception as exc:  # noqa: BLE001 - a bad step loses its frames, never the sender
            self.counters["frames_dropped_build_error"] += count
            self.last_build_error = repr(exc)
            return []

    def _run(self) -> None:
        import zmq

        if self.cpus:
            try:
                os.sched_setaffinity(0, self.cpus)  # this thread only (Linux); before ZeroMQ starts its I/O thread
            except OSError as exc:
                self.cpus_error, self.cpus = str(exc), []
        if self.idle:
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread; ZeroMQ's inherits it
            except (AttributeError, OSError) as exc:
                self.sched_error, self.idle = str(exc), False
        # A context of its own: its I/O thread starts here, with this thread's CPUs.
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        try:
            while not self._stop.is_set():
                self._read_connection_events(monitor)
                try:
                    count, item = self._queue.get(timeout=0.2)
                except queue.Empty:
                    continue
                try:
                    for header, tensors in self._frames_of(count, item):
                        parts = encode_frame(header, tensors)
                        if not self._send(sock, parts):
                            self._read_connection_events(monitor)
                            self.counters["frames_dropped_peer_busy" if self._peers else "frames_dropped_no_peer"] += 1
                            continue
                        self.counters["frames_sent"] += 1
                        self.counters["bytes_sent"] += sum(len(p) for p in parts)
                finally:
                    with self._queued_lock:
                        self._queued -= count
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            ctx.term()

    def _read_connection_events(self, monitor) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._peers += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self._peers = max(0, self._peers - 1)

    def _send(self, sock, parts: list) -> bool:
        """Hand a frame to ZeroMQ without blocking; with ``send_timeout_s``, retry while the peer
        catches up (or until the sender is closed)."""
        import zmq

        deadline = time.monotonic() + self.send_timeout_s
        while True:
            try:
                sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                if self._stop.is_set() or time.monotonic() >= deadline:
                    return False
                sock.poll(50, zmq.POLLOUT)

    def state(self) -> dict[str, Any]:
        return {"address": self.address, **self.counters, "queued": self._queued,
                "trainer_connected": self._peers > 0, "sender_cpus": self.cpus,
                "sender_sched": "idle" if self.idle else "normal",
                **({"sender_cpus_error": self.cpus_error} if self.cpus_error else {}),
                **({"sender_sched_error": self.sched_error} if self.sched_error else {}),
                **({"last_build_error": self.last_build_error} if self.last_build_error else {})}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
