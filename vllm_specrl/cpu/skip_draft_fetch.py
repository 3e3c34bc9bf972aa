"""No draft fetch after a step that asked for none (an engine-core patch for adaptive k's k = 0 steps).

After every step of a synchronously scheduled speculative engine,
``EngineCore.post_step`` fetches the drafts the worker proposed
(``take_draft_token_ids``): with ``vllm serve``'s multi-process executor, one more
engine-core -> worker RPC per step. A step scheduled with
``num_spec_tokens_to_schedule == 0`` (adaptive k or vLLM's batch-size table at k = 0)
proposes an empty draft per request, and the scheduler already cleared every
request's ``spec_token_ids`` when it scheduled the step, so the fetch changes
nothing: it is skipped. Not for ``custom_class`` proposers, which vLLM 0.32 does not
hand the step's k (they draft at k = 0 steps too, and those drafts are then scheduled,
truncated to the next step's k). ``VLLM_SPECRL_SKIP_EMPTY_DRAFT_FETCH=0`` keeps
vLLM's path.
"""

from __future__ import annotations

from typing import Any

from vllm_specrl.compat.registry import REGISTRY, Patch

SKIP_EMPTY_DRAFT_FETCH_ENV = "VLLM_SPECRL_SKIP_EMPTY_DRAFT_FETCH"


SKIP_FETCH_WHY = ("no take_draft_token_ids RPC after a step scheduled with k = 0, whose drafts are empty "
                  "(CPU step cost: one engine-core -> worker RPC a step)")
SKIP_FETCH_POST_STEP_PATCH = REGISTRY.declare(Patch(shortcut=True,
    name="skip_empty_draft_fetch", target="vllm.v1.engine.core:EngineCore.post_step", why=SKIP_FETCH_WHY,
    scope="cpu", switch=SKIP_EMPTY_DRAFT_FETCH_ENV, checked_on=("vLLM 0.32.0, CPU",),
    signature=("self", "model_executed")))
SKIP_FETCH_SCHEDULE_PATCH = REGISTRY.declare(Patch(shortcut=True,
    name="skip_empty_draft_fetch.schedule", target="vllm.v1.core.sched.scheduler:Scheduler.schedule",
    why="records the k each step was scheduled with, for skip_empty_draft_fetch", scope="cpu",
    switch=SKIP_EMPTY_DRAFT_FETCH_ENV, checked_on=("vLLM 0.32.0, CPU",)))


def install_skip_empty_draft_fetch() -> str:
    """Skip ``take_draft_token_ids`` after steps that asked for no drafts (see above); counts skips
    on the engine core (``_specrl_skipped_draft_fetches``)."""
    if REGISTRY.is_installed(SKIP_FETCH_POST_STEP_PATCH.name):
        return "installed"

    def wrap_post_step(stock_post_step):
        def post_step(self, model_executed: bool) -> None:
            spec = self.vllm_config.speculative_config
            # With a batch queue (pipeline parallel) the step that finished is not always the last scheduled.
            if (model_executed and not self.async_scheduling and self.batch_queue is None and spec is not None
                    and spec.method != "custom_class" and getattr(self.scheduler, "_specrl_drafts_asked", None) == 0):
                self._specrl_skipped_draft_fetches = getattr(self, "_specrl_skipped_draft_fetches", 0) + 1
                return
            stock_post_step(self, model_executed)
        return post_step

    def wrap_schedule(stock_schedule):
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            out = stock_schedule(self, *args, **kwargs)
            self._specrl_drafts_asked = out.num_spec_tokens_to_schedule
            return out
        return schedule

    # post_step skips only where schedule recorded k = 0: alone it changes nothing.
    return REGISTRY.install_all([(SKIP_FETCH_POST_STEP_PATCH, wrap_post_step),
                                 (SKIP_FETCH_SCHEDULE_PATCH, wrap_schedule)])
