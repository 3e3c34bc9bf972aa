"""Device rows to the host without stopping the engine step: pinned buffers, non-blocking copies, an event.

On a GPU a blocking ``.to("cpu")`` inside the step waits for every kernel queued before it: a device
synchronisation per step, which async scheduling and CUDA graphs exist to avoid. Here the step only
enqueues: each tensor is copied with ``non_blocking=True`` into a pinned host buffer on the step's own
stream (stream order keeps the source valid until the copy has read it, however the runner reuses its
buffers next step), and one event is recorded after the step's copies. The reader (the capture sender's
thread) waits on that event before it reads, and hands the buffers back when done; a buffer is reused only
once handed back. When every buffer is in flight the step's rows are dropped and counted, never waited for.

Written for CUDA and not run here (no GPU in the project's machines): the ordering is tested with stand-in
stream, event and copy objects whose contract a missing wait or an early reuse breaks
(``tests/capture/test_host_staging.py``). On a CPU engine nothing is staged: rows are copied as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Event(Protocol):
    def record(self) -> None: ...

    def synchronize(self) -> None: ...


@dataclass
class DeviceOps:
    """What staging asks of the device: the real CUDA calls, or a test's stand-ins."""

    pinned_empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
    copy_async: Callable[[torch.Tensor, torch.Tensor], None]   # dst (host) <- src (device), non-blocking
    new_event: Callable[[], Event]
    to_device: Callable[[list[int], torch.device], torch.Tensor]   # host ints -> device, non-blocking


def _ints_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    # From pinned memory: a pageable host-to-device copy would synchronise the stream.
    return torch.tensor(values, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


def cuda_ops() -> DeviceOps:
    return DeviceOps(pinned_empty=lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True),
                     copy_async=lambda dst, src: dst.copy_(src, non_blocking=True),
                     new_event=torch.cuda.Event, to_device=_ints_to_device)


@dataclass
class StagedCopies:
    """One step's host copies: readable after ``wait()``, to be ``release()``d once read."""

    tensors: dict[str, torch.Tensor]
    event: Event
    _buffers: list[torch.Tensor] = field(default_factory=list)
    _pool: StagingPool | None = None

    def wait(self) -> dict[str, torch.Tensor]:
        """Block the *reader* until the step's copies have landed."""
        self.event.synchronize()
        return self.tensors

    def release(self) -> None:
        if self._pool is not None:
            self._pool.give_back(self._buffers)
            self._pool, self._buffers = None, []


class StagingPool:
    """Pinned host buffers by (shape, dtype), at most ``max_buffers`` in all; a buffer in flight (copied
    into, not yet released by its reader) is never handed out again."""

    def __init__(self, ops: DeviceOps | None = None, max_buffers: int = 64):
        self.ops = ops or cuda_ops()
        self.max_buffers = max_buffers
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._count = 0
        self._lock = threading.Lock()   # the step takes, the sender thread gives back
        self.counters = {"steps_staged": 0, "steps_dropped_no_buffer": 0, "buffers": 0}

    def _take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        with self._lock:
            free = self._free.get((shape, dtype))
            if free:
                return free.pop()
            if self._count >= self.max_buffers:
                return None
            self._count += 1
            self.counters["buffers"] = self._count
        return self.ops.pinned_empty(shape, dtype)

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for buf in buffers:
                self._free.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)

    def stage(self, tensors: dict[str, torch.Tensor]) -> StagedCopies | None:
        """Enqueue a host copy of every tensor and one event after them; None (counted) when the pool
        has no buffer left: the step goes on without its rows."""
        taken: list[torch.Tensor] = []
        out: dict[str, torch.Tensor] = {}
        for name, src in tensors.items():
            buf = self._take(tuple(src.shape), src.dtype)
            if buf is None:
                self.give_back(taken)
                self.counters["steps_dropped_no_buffer"] += 1
                return None
            taken.append(buf)
            self.ops.copy_async(buf, src)
            out[name] = buf
        event = self.ops.new_event()
        event.record()
        self.counters["steps_staged"] += 1
        return StagedCopies(out, event, taken, self)


def stages(tensor: Any) -> bool:
    """Whether rows on this tensor's device go through staging (a CUDA device), or are copied at once."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda"
