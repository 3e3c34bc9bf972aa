"""Where a benchmark's engine step spends its time: phase timers on a model runner (benchmarks only).

Where a step's time goes: forward hooks on the runner's modules (target model,
sampler, rejection sampler, the drafter's model) and instance wraps of the
runner's ``execute_model`` / ``sample_tokens`` / ``propose_draft_token_ids``, the
target's ``compute_logits`` and the drafter's ``_sample_draft_tokens``. CPU only
(no asynchronous kernels to synchronise).
"""

from __future__ import annotations

from typing import Any

PHASES = ("step", "target_forward", "target_logits", "sampler", "rejection_sampler", "propose",
          "draft_forward", "draft_logits_and_sampling")


def timed_into(totals: dict[str, float], name: str, fn: Any, count: str | None = None) -> Any:
    """``fn`` wrapped to add its seconds to ``totals[name]`` (and 1 to ``totals[count]``) per call."""
    import time

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
            if count:
                totals[count] += 1
    return wrapper


def in_process_scheduler(llm: Any) -> Any:
    """The scheduler of an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): its
    ``LLMEngine``'s ``InprocClient``'s ``EngineCore``'s, for the benchmark's scheduler timers."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def install_phase_timers(runner: Any) -> dict[str, float]:
    """Accumulate seconds per phase into the returned dict (plus ``steps``, ``steps_with_drafts``)."""
    import functools
    import time

    totals = getattr(runner, "_specrl_phase_totals", None)
    if totals is not None:
        return totals
    totals = runner._specrl_phase_totals = dict.fromkeys(PHASES, 0.0)
    totals.update(steps=0, forward_calls=0)
    timed = functools.partial(timed_into, totals)

    def hook(module, name):
        starts = []
        module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))

        def done(*_):
            totals[name] += time.perf_counter() - starts.pop()
        module.register_forward_hook(done)

    runner.execute_model = timed("step", runner.execute_model, "steps")
    runner.sample_tokens = timed("step", runner.sample_tokens)
    model = runner.get_model()
    hook(model, "target_forward")
    model.compute_logits = timed("target_logits", model.compute_logits)
    for attr, name in (("sampler", "sampler"), ("rejection_sampler", "rejection_sampler")):
        if getattr(runner, attr, None) is not None:
            hook(getattr(runner, attr), name)
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        runner.propose_draft_token_ids = timed("propose", runner.propose_draft_token_ids)
        if getattr(drafter, "model", None) is not None:
            hook(drafter.model, "draft_forward")
        if hasattr(drafter, "_sample_draft_tokens"):
            drafter._sample_draft_tokens = timed("draft_logits_and_sampling", drafter._sample_draft_tokens)
    return totals
