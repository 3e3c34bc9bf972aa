"""Same-host shared-memory transport: a safetensors file on tmpfs (/dev/shm).

The trainer writes a chunk of tensors to RAM-backed tmpfs; the worker reads
it back with safetensors (no pickling, no sockets, no HTTP body); the writer
deletes it once the worker has staged it. Used automatically by
``EngineClient`` when the engine runs on the same host.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import torch

SHM_DIR = Path(os.environ.get("VLLM_SPECRL_SHM_DIR", "/dev/shm"))


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def write_chunk(tensors: dict[str, torch.Tensor]) -> Path:
    """Write one chunk; the caller deletes it (``path.unlink``) after the worker staged it."""
    from safetensors.torch import save_file

    path = SHM_DIR / f"specrl-{os.getpid()}-{uuid.uuid4().hex[:10]}.safetensors"
    fd, name = tempfile.mkstemp(dir=SHM_DIR, prefix=".specrl-tmp-")  # created 0600, never guessed
    os.close(fd)
    tmp = Path(name)
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp)
        tmp.rename(path)  # the worker never sees a half-written file
    finally:
        tmp.unlink(missing_ok=True)
    return path
