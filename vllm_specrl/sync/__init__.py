"""In-place weight sync for policy and draft (worker extension and, later, transports)."""

from vllm_specrl.sync.worker_extension import SpecRLWorkerExtension

__all__ = ["SpecRLWorkerExtension"]
