"""``--scheduler-cls vllm_specrl.adaptive.scheduler.AdaptiveKScheduler``: vLLM's scheduler with k chosen per step.

vLLM picks the scheduler class by name; this one becomes vLLM's own scheduler
(the asynchronous one when async scheduling is on, the default for EAGLE on GPUs;
vLLM's CPU platform turns it off) with the adaptive-k controller attached
(``vllm_compat.adaptive_k_scheduler_class``).
Knobs: ``--additional-config '{"specrl": {"adaptive_k": {"explore": 0.03, ...}}}'``
(``controller.AdaptiveKConfig``).
"""

from __future__ import annotations

from typing import Any


class AdaptiveKScheduler:
    """Constructs vLLM's scheduler of the configured kind, with adaptive k."""

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm_specrl import vllm_compat

        return vllm_compat.adaptive_k_scheduler_class(vllm_config)(vllm_config, *args, **kwargs)
