"""Same-host shared-memory transport: a safetensors file on tmpfs (/dev/shm).

The trainer writes a chunk of tensors to RAM-backed tmpfs; the worker reads
it back with safetensors (no pickling, no sockets, no HTTP body); the writer
deletes it once the worker has staged it. Used automatically by
``EngineClient`` when the engine runs on the same host and its workers read
what the client writes there (a probe file: a client in another container
has another ``/dev/shm`` under the same name).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

SHM_DIR = Path(os.environ.get("VLLM_SPECRL_SHM_DIR", "/dev/shm"))


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def map_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file on tmpfs as views of its pages, not copies: safetensors maps
    the file copy-on-write, so every tensor-parallel rank of a host that maps the same file shares one
    host copy (the pages outlive the file's name, so the writer may delete it at once; they are freed
    when the last view goes), and a loader that writes into a tensor it is given gets private pages,
    never a change another rank sees."""
    from safetensors.torch import load_file

    return load_file(Path(path))


def write_probe() -> tuple[Path, str]:
    """A tiny safetensors file whose metadata holds a random token: the engine's workers read it back
    (``/specrl/shm/probe``) only if they share this host's shared memory."""
    token = uuid.uuid4().hex
    path = write_chunk({}, metadata={"specrl_probe": token})
    return path, token


def read_probe(path: str | Path) -> str | None:
    """The token in a probe file, or None when this process cannot read it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as fh:
            return (fh.metadata() or {}).get("specrl_probe")
    except Exception:  # noqa: BLE001 - absent, unreadable or foreign: not shared
        return None


def write_chunk(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Write one chunk; the caller deletes it (``path.unlink``) after the worker staged it."""
    from safetensors.torch import save_file

    return _write_whole(lambda tmp: save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                                              tmp, metadata=metadata))


def write_bytes(data: bytes) -> Path:
    """Write an already serialised chunk (an HTTP body: a whole safetensors file), as ``write_chunk``."""
    return _write_whole(lambda tmp: tmp.write_bytes(data))


def _write_whole(fill: Callable[[Path], object]) -> Path:
    """A new ``specrl-*.safetensors`` file in ``SHM_DIR`` that ``fill`` writes: under a private temporary
    name first, so a reader never sees a half-written file. ``OSError`` when shared memory is full."""
    path = SHM_DIR / f"specrl-{os.getpid()}-{uuid.uuid4().hex[:10]}.safetensors"
    fd, name = tempfile.mkstemp(dir=SHM_DIR, prefix=".specrl-tmp-")  # created 0600, never guessed
    os.close(fd)
    tmp = Path(name)
    try:
        fill(tmp)
        tmp.rename(path)  # the worker never sees a half-written file
    finally:
        tmp.unlink(missing_ok=True)
    return path
