"""In-place weight sync for policy and draft, by role: ``worker`` (the extension vLLM mixes into every worker,
staging, validation, the load), ``http`` (the ``/specrl/update/*`` routes), ``backends`` (vLLM
weight-transfer backends), ``watch`` (every other load path seen and versioned), ``clients`` (what a
trainer calls). ``shm`` and ``all_or_none`` are shared by several of them.

``vllm_specrl.sync.SpecRLWorkerExtension`` is the path ``--worker-extension-cls`` takes; it is imported on
first use, so that a client importing ``vllm_specrl.sync.clients`` does not import torch.
"""

from typing import Any

__all__ = ["SpecRLWorkerExtension"]


def __getattr__(name: str) -> Any:
    if name == "SpecRLWorkerExtension":
        from vllm_specrl.sync.worker.extension import SpecRLWorkerExtension

        return SpecRLWorkerExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
