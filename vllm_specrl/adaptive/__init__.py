"""Adaptive k: the number of speculative tokens chosen per step from live acceptance and cost."""

# What ``--scheduler-cls`` / ``LLM(scheduler_cls=...)`` takes to turn adaptive k on.
SCHEDULER_CLS = "vllm_specrl.adaptive.scheduler.AdaptiveKScheduler"
