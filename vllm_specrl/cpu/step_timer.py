"""The model runner's own step time, handed to the adaptive-k scheduler.

The adaptive-k controller needs what a step of each k costs. The interval between
the scheduler's outputs also holds the engine loop's and the output processing's
time, which jitter from step to step on a shared CPU. The
runner's time from ``execute_model`` entry to ``sample_tokens`` exit (forward,
sampling, rejection sampling, drafting) is attached to the ``ModelRunnerOutput``
as ``specrl_runner_seconds``; the dataclass is pickled to the engine core with its
``__dict__``, so the attribute survives the multi-process executor. CPU only: on
a GPU the runner returns before its kernels finish.
"""

from __future__ import annotations

from typing import Any

from vllm_specrl.compat.cpu_seeded_rewind import SEEDED_REWIND_ORDER
from vllm_specrl.compat.registry import REGISTRY, Patch

RUNNER_SECONDS_ATTR = "specrl_runner_seconds"
STEP_TIMER_ENV = "VLLM_SPECRL_RUNNER_STEP_TIMER"
_WHY = ("the runner's time per step (forward, sampling, drafting) for adaptive k's cost of each k, which the "
        "interval between scheduler outputs blurs; CPU only: on a GPU the runner returns before its kernels finish")
_RUNNER = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"
_DEFINED = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
STEP_TIMER_EXECUTE_PATCH = REGISTRY.declare(Patch(shortcut=True,
    name="runner_step_timer", target=f"{_RUNNER}.execute_model", why=_WHY, scope="cpu", switch=STEP_TIMER_ENV,
    checked_on=("vLLM 0.32.0, CPU",), signature=("self", "scheduler_output", "intermediate_tensors"),
    defined_in=f"{_DEFINED}.execute_model"))
STEP_TIMER_SAMPLE_PATCH = REGISTRY.declare(Patch(shortcut=True,
    name="runner_step_timer.sample_tokens", target=f"{_RUNNER}.sample_tokens", why=_WHY, scope="cpu",
    switch=STEP_TIMER_ENV, checked_on=("vLLM 0.32.0, CPU",), signature=("self", "grammar_output"),
    order=SEEDED_REWIND_ORDER + 1, defined_in=f"{_DEFINED}.sample_tokens"))


def install_runner_step_timer() -> str:
    """Wrap the CPU model runner's ``execute_model`` / ``sample_tokens`` to time each step."""
    import time

    from vllm.v1.outputs import ModelRunnerOutput

    if REGISTRY.is_installed(STEP_TIMER_EXECUTE_PATCH.name):
        return "installed"

    def stamp(output: Any, start: float | None) -> Any:
        if start is not None and isinstance(output, ModelRunnerOutput):
            setattr(output, RUNNER_SECONDS_ATTR, time.perf_counter() - start)
        return output

    def wrap_execute(stock_execute):
        def execute_model(self, *args, **kwargs):
            self._specrl_step_start = start = time.perf_counter()
            return stamp(stock_execute(self, *args, **kwargs), start)
        return execute_model

    def wrap_sample(stock_sample):
        def sample_tokens(self, *args, **kwargs):
            start, self._specrl_step_start = getattr(self, "_specrl_step_start", None), None
            return stamp(stock_sample(self, *args, **kwargs), start)
        return sample_tokens

    return REGISTRY.install_all([(STEP_TIMER_EXECUTE_PATCH, wrap_execute), (STEP_TIMER_SAMPLE_PATCH, wrap_sample)])


def runner_seconds(model_runner_output: Any) -> float | None:
    """The runner's time for the step that produced this output, where the timer was installed."""
    value = getattr(model_runner_output, RUNNER_SECONDS_ATTR, None)
    return float(value) if value is not None else None
