"""Worker-side RPCs, installed with ``--worker-extension-cls vllm_specrl.sync.SpecRLWorkerExtension``.

vLLM appends this class to the worker's bases, so ``self`` is the worker and
every method is reachable through ``collective_rpc``. All names start with
``specrl_`` because vLLM asserts that an extension never shadows a worker
attribute, and its ``__init__`` is never called (state is created lazily).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

from vllm_specrl import plugin, vllm_compat
from vllm_specrl._version import __version__


class SpecRLWorkerExtension:
    """Mixin for vLLM workers; see the module docstring."""

    def specrl_status(self) -> dict[str, Any]:
        """What the plugin and the model look like from inside this worker process."""
        return {
            "pid": os.getpid(),
            "process": multiprocessing.current_process().name,
            "rank": getattr(self, "rank", None),
            "vllm_specrl": __version__,
            "plugin": plugin.state(),
            **vllm_compat.worker_model_summary(self),
        }
