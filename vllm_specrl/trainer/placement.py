"""Where the draft trainer runs: ``--device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``).

On a GPU node vLLM takes most of each GPU it serves on (``gpu_memory_utilization``, 0.9 by default), so
"the first CUDA device" is the worst place for a trainer that starts after the engine. ``auto`` picks
the visible GPU with the most free memory (a spare GPU, or the trainer's own), and the CPU where there
is none; an explicit device is used as given. Accelerate reads the choice from ``ACCELERATE_TORCH_DEVICE``
(its process-wide state is set once, when the first ``Accelerator`` is built).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch

DEVICE_ENV = "ACCELERATE_TORCH_DEVICE"
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _free_bytes(index: int) -> int:
    return int(torch.cuda.mem_get_info(index)[0])


def resolve_device(setting: str = "auto", cuda_count: int | None = None,
                   free_bytes: Callable[[int], int] = _free_bytes) -> str:
    """The device the trainer runs on (``cpu`` or ``cuda:N``); a bad setting is a ``ValueError``."""
    if not _DEVICE.match(setting or ""):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {setting!r}")
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if setting == "cpu" or (setting == "auto" and count == 0):
        return "cpu"
    if count == 0:
        raise ValueError(f"device {setting!r} asked for, but no CUDA device is visible")
    if setting == "auto":
        return f"cuda:{max(range(count), key=free_bytes)}"
    index = int(setting.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(f"device {setting!r} asked for, but only {count} CUDA device(s) are visible")
    return f"cuda:{index}"


def place(setting: str = "auto") -> str:
    """Resolve ``setting`` and make it the device the process's ``Accelerator`` takes."""
    device = resolve_device(setting)
    os.environ[DEVICE_ENV] = device
    return device
