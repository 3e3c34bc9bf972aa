"""``--scheduler-cls vllm_specrl.adaptive.scheduler.AdaptiveKScheduler``: vLLM's scheduler with k chosen per step.

vLLM picks the scheduler class by name; this one becomes vLLM's own scheduler
(the asynchronous one when async scheduling is on, the default for EAGLE on GPUs;
vLLM's CPU platform turns it off) with the adaptive-k controller attached.
Knobs: ``--additional-config '{"specrl": {"adaptive_k": {"explore": 0.03, ...}}}'``
(``controller.AdaptiveKConfig``).

vLLM 0.32's scheduler reads ``self.dynamic_sd_lookup[len(num_scheduled_tokens)]``
(a dense batch-size -> k table, built from ``num_speculative_tokens_per_batch_size``)
once per step to set ``SchedulerOutput.num_spec_tokens_to_schedule``: how many
tokens the drafter proposes for the next step (0 allowed: EAGLE then runs only its
KV-keeping first pass). With a table present, vLLM also stops padding decode
requests to 1 + k. The subclass below owns that table and rewrites it before
every ``schedule()`` from the adaptive-k controller, and feeds the controller in
``update_from_output`` (scheduled drafts per request, accepted = sampled - 1,
wall time between outputs; the sampled tokens are read before the stock method, which
trims a stopped request's list in place: ``Scheduler._update_request_with_output``). Start-up
calibration requests (``vllm_specrl.adaptive.k_sweep``)
are recognised by their request ids, which carry the deployment's secret (``calibration_ids``) in the
``X-Request-Id`` header the sweep sends (``cmpl-<header>-<i>``, then vLLM's ``-<random>`` suffix): while the
scheduler's queues hold
only those, the controller sweeps every k, and their drafts never reach its acceptance
estimate. Checked on 0.32.0 (cpu), Scheduler and AsyncScheduler (``running``, ``waiting``).
Behaviour relied on, with a parallel (P-EAGLE) drafter: steps at k = 0 between steps at the
configured k serve, any other k > 0 fails (``scripts/repro/repro_parallel_drafting_varying_k.py``;
tests/proposer/test_eagle3_engine.py::test_adaptive_k_serves_a_parallel_draft_at_zero_or_its_k).
"""

from __future__ import annotations

import atexit
import itertools
import time
from typing import Any

from vllm_specrl._log import logger
from vllm_specrl.adaptive import state as adaptive_state
from vllm_specrl.adaptive.controller import AdaptiveKConfig, AdaptiveKController
from vllm_specrl.adaptive.calibration_ids import is_calibration_request, only_calibration
from vllm_specrl.cpu.step_timer import runner_seconds
from vllm_specrl.compat.engine_config import process_role, specrl_additional_config
from vllm_specrl.instance_state import instance_dir


NO_K_PAYS_WARNING = (
    "adaptive k: no k pays at any batch size measured (first-draft acceptance %.2f; step time of each k "
    "against the served k = 0, by batch size: %s). The engine serves k = 0 and still pays the drafter's "
    "per-step bookkeeping, most visible on a small, fast model: serve without --speculative-config, or "
    "with a better draft (vllm-specrl train-draft). /specrl/status says so while it holds (no_k_pays).")


class AdaptiveKScheduler:
    """Constructs vLLM's scheduler of the configured kind, with adaptive k (``scheduler_class``)."""

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        return scheduler_class(vllm_config)(vllm_config, *args, **kwargs)


_CLASSES: dict[type, type] = {}


def scheduler_class(vllm_config: Any) -> type:
    """The factory: vLLM's scheduler class for this config (``AsyncScheduler`` when async scheduling is
    on, else ``Scheduler``) with ``AdaptiveKMixin`` in front of it, built once per base."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    base = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
    if base not in _CLASSES:
        _CLASSES[base] = type(f"AdaptiveK{base.__name__}", (AdaptiveKMixin, base), {})
    return _CLASSES[base]


class AdaptiveKMixin:
    """What adaptive k adds to vLLM's scheduler: the controller's k table before every ``schedule()``,
    and every step's drafts, acceptance and time fed back in ``update_from_output``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        raw = specrl_additional_config(self.vllm_config).get("adaptive_k", True)
        self._specrl_controller = None
        if self.num_spec_tokens <= 0 or raw is False:
            return
        self._specrl_controller = self._make_controller(raw)
        self.dynamic_sd_lookup = [self.num_spec_tokens] * (self.scheduler_config.max_num_seqs + 1)
        self._specrl_last_output = None
        self._specrl_last_publish = 0.0
        self._specrl_told_no_k_pays = False
        # In the serve instance's shared directory, one file per engine core (data parallelism).
        self._specrl_state_path = adaptive_state.state_path(
            instance_dir(engine_core=process_role() == "engine_core"),
            int(getattr(self.vllm_config.parallel_config, "data_parallel_index", None)
                or self.vllm_config.parallel_config.data_parallel_rank or 0))
        atexit.register(adaptive_state.remove, self._specrl_state_path)

    def _make_controller(self, raw: Any) -> AdaptiveKController:
        # vLLM's parallel drafter lays out its mask slots for the configured k: a step at any other
        # k > 0 fails on 0.32.0 (a tensor size mismatch, also under vLLM's own
        # num_speculative_tokens_per_batch_size), while k = 0 steps between k = K ones serve. So a
        # parallel draft is served at 0 or K only (its drafter's one pass costs about the same at any k).
        parallel = bool(getattr(self.vllm_config.speculative_config, "parallel_drafting", False))
        choices = (0, self.num_spec_tokens) if parallel else None
        return AdaptiveKController(self.num_spec_tokens, self.scheduler_config.max_num_seqs,
                                   AdaptiveKConfig.from_dict(raw), choices=choices)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        controller = self._specrl_controller
        if controller is not None:
            queued = (r.request_id for r in itertools.chain(self.running, self.waiting))
            self.dynamic_sd_lookup = controller.lookup_for_step(calibrating=only_calibration(queued))
            if getattr(self, "_specrl_refused", False):  # the drafter lifecycle stopped drafting
                self.dynamic_sd_lookup = [0] * len(self.dynamic_sd_lookup)
        out = super().schedule(*args, **kwargs)
        if controller is not None and out.num_scheduled_tokens:
            controller.record_choice(len(out.num_scheduled_tokens), out.num_spec_tokens_to_schedule,
                                     calibrating=only_calibration(out.num_scheduled_tokens))
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        controller = self._specrl_controller
        # Read before vLLM's own update: a request that stops mid-verify (max_tokens, EOS, a stop
        # token) has its list of sampled tokens trimmed in place there (``del new_token_ids[n:]``),
        # which would count its accepted drafts past the stop as rejected.
        spec = scheduler_output.scheduled_spec_decode_tokens
        verified = verified_drafts(scheduler_output, model_runner_output) if controller and spec else []
        result = super().update_from_output(scheduler_output, model_runner_output)
        scheduled = scheduler_output.num_scheduled_tokens
        if controller is None or not scheduled:
            return result
        now = time.perf_counter()
        k, clean = _step_shape(scheduler_output)
        seconds = now - self._specrl_last_output if (clean and self._specrl_last_output) else None
        controller.observe_step(len(scheduled), k, scheduler_output.num_spec_tokens_to_schedule, seconds,
                                verified, runner_seconds(model_runner_output),
                                calibrating=only_calibration(scheduled))
        # An idle engine makes no outputs: the next interval would count the idle time.
        busy = bool(self.get_num_unfinished_requests())
        self._specrl_last_output = now if busy else None
        if now - self._specrl_last_publish > 0.5 or not busy:
            self._specrl_last_publish = now
            self._publish_state(controller)
        return result

    def _publish_state(self, controller: AdaptiveKController) -> None:
        state = controller.state()
        if state["no_k_pays"] and not self._specrl_told_no_k_pays:
            logger.warning(NO_K_PAYS_WARNING, state["conditional_acceptance"][0],
                           {name: b["step_time_vs_served"] for name, b in state["buckets"].items()
                            if b["calibrated"] and not b["from_neighbour"]})
        self._specrl_told_no_k_pays = state["no_k_pays"]
        try:
            adaptive_state.publish(state, self._specrl_state_path)
        except OSError:
            pass  # reporting must never break scheduling


def _step_shape(scheduler_output: Any) -> tuple[int, bool]:
    """(the k every request verified, whether the step was clean: every request verified that k and
    nothing else was scheduled, no new request)."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    scheduled = scheduler_output.num_scheduled_tokens
    if spec:
        k_verify = {len(spec.get(rid, ())) for rid in scheduled}
        k = k_verify.pop() if len(k_verify) == 1 else None
        clean = k is not None and all(n == 1 + k for n in scheduled.values())
    else:  # no drafts (every step at k = 0): one token per request
        k, clean = 0, scheduler_output.total_num_scheduled_tokens == len(scheduled)
    return k or 0, clean and not scheduler_output.scheduled_new_reqs


def verified_drafts(scheduler_output: Any, model_runner_output: Any) -> list[tuple[int, int]]:
    """``(drafts, accepted)`` per request that verified drafts this step, as vLLM's ``spec_decode``
    counters count them (accepted = tokens sampled - 1), calibration requests left out (synthetic
    drafts: their acceptance says nothing about the workload's)."""
    verified = []
    # Rows are in ``req_ids`` order (vLLM 0.34 dropped ``req_id_to_index``, which 0.32 kept beside it).
    index = {rid: row for row, rid in enumerate(model_runner_output.req_ids)}
    sampled = model_runner_output.sampled_token_ids
    for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
        row = index.get(rid)
        if drafts and row is not None and row < len(sampled) and not is_calibration_request(rid):
            emitted = len(sampled[row])
            if emitted:
                verified.append((len(drafts), min(emitted - 1, len(drafts))))
    return verified
