"""Engine patches as named, gated, reversible objects.

A patch replaces one attribute of a vLLM class or module. The registry keeps the original, checks its
signature before touching it, installs a patch only where it applies (a patch whose reason is a CPU
fault or a CPU measurement: on the CPU platform only, unless its switch says ``1``), refuses to install
a patch twice or over an attribute someone else changed, composes several patches on one attribute in a
defined order, and uninstalls a patch leaving the original object itself in place. ``report()`` says
what happened to every declared patch in this process: what ``/specrl/status`` and ``vllm-specrl
doctor`` list.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Where a patch applies: "cpu" (a CPU fault or a CPU measurement: the CPU platform only unless switched on)
# or "everywhere" (needed for correctness on any platform; its declaration says why).
SCOPES = ("cpu", "everywhere")
CPU_ONLY_NOTE = "measured on the CPU platform only"
# One switch for every CPU performance shortcut (``Patch.shortcut``; the fixes of vLLM faults keep their own):
# ``0`` turns them off where their own switch is unset.
SHORTCUTS_SWITCH = "VLLM_SPECRL_CPU_SHORTCUTS"


class PatchError(RuntimeError):
    """A patch that must not be installed or removed as asked (installed twice, never installed, or
    its attribute changed behind the registry's back)."""


@dataclass(frozen=True)
class Patch:
    """One replacement of one vLLM attribute, with everything a reader or a user needs to judge it.

    ``target`` is ``"module:Class.attribute"`` or ``"module:attribute"``. ``signature``: the original's
    parameter names as checked (a drift skips the patch with the reason logged). ``order``: patches on
    the same attribute wrap in ascending order, the lowest closest to vLLM's original. ``defined_in``:
    where vLLM's source defines a target its class inherits (what the touch-point check reads).
    ``also_checked``: further signatures the replacement was written for (read from a later vLLM).
    ``shortcut``: a CPU performance shortcut (not a fix), also off under ``SHORTCUTS_SWITCH=0``."""

    name: str
    target: str
    why: str
    scope: str
    switch: str
    checked_on: tuple[str, ...]
    signature: tuple[str, ...] | None = None
    repro: str | None = None
    order: int = 0
    defined_in: str | None = None  # "module:Class.attr" where vLLM defines an inherited target
    also_checked: tuple[tuple[str, ...], ...] = ()  # other signatures the patch handles (a later vLLM's)
    shortcut: bool = False

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"patch {self.name}: scope must be one of {SCOPES}, not {self.scope!r}")
        if ":" not in self.target:
            raise ValueError(f"patch {self.name}: target must read 'module:Owner.attribute', not {self.target!r}")

    @property
    def owner_path(self) -> tuple[str, str]:
        module, _, rest = self.target.partition(":")
        return module, rest.rpartition(".")[0]

    @property
    def attribute(self) -> str:
        return self.target.partition(":")[2].rpartition(".")[2]

    def touch_point(self) -> TouchPoint:
        """What this patch relies on in vLLM's source: the patched function, with its parameters."""
        module, _, dotted = (self.defined_in or self.target).partition(":")
        return TouchPoint(module_file(module), dotted, "function", f"patch {self.name}")


@dataclass(frozen=True)
class TouchPoint:
    """One vLLM internal the package reads without patching it, checked against vLLM's source by
    ``scripts/check_vllm_touch_points.py``. ``file`` is under ``vllm/``; ``kind`` is ``function``
    (its parameters), ``class`` (it exists), ``attrs:a,b`` (assigned on ``self`` or declared in the
    class) or ``names:a,b`` (module-level names, ``name`` empty)."""

    file: str
    name: str
    kind: str
    used_for: str
    # Which model runner relies on it: "any" (every supported vLLM), "v1" (vLLM 0.32 / 0.33's V1 runner,
    # removed in 0.34), "mrv2" (the Model Runner V2 port, vLLM >= 0.34's registry of speculators).
    runner: str | None = None  # None: from the file (``runner_of_file``)
    # A function's parameter lists the package was written for (each as the check reads it); when set,
    # the verdict is against these, not against the reference vLLM's.
    signatures: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.runner is None:
            object.__setattr__(self, "runner", runner_of_file(self.file))
        if self.runner not in RUNNERS:
            raise ValueError(f"touch point {self.name}: runner must be one of {RUNNERS}, not {self.runner!r}")


RUNNERS = ("any", "v1", "mrv2")
# vLLM sources only the V1 model runner uses: every one is gone or rewritten in vLLM 0.34, whose Model
# Runner V2 the ``mrv2`` port serves instead.
V1_RUNNER_FILES = ("v1/worker/gpu_model_runner.py", "v1/worker/cpu_model_runner.py", "v1/worker/gpu_input_batch.py",
                   "v1/sample/", "v1/spec_decode/", "utils/cpu_triton_utils.py")


def runner_of_file(file: str) -> str:
    """``v1`` for a source only the V1 runner uses, else ``any``."""
    return "v1" if file.startswith(V1_RUNNER_FILES) else "any"


def module_file(module: str) -> str:
    """``vllm.v1.worker.gpu_model_runner`` -> ``v1/worker/gpu_model_runner.py`` (a package: its ``__init__``)."""
    parts = module.split(".")
    parts = parts[1:] if parts[0] == "vllm" and len(parts) > 1 else parts
    return "/".join(parts) + ".py" if parts[-1] not in _PACKAGES else "/".join(parts) + "/__init__.py"


_PACKAGES = {"plugins"}  # vLLM packages whose __init__ holds a touched name


@dataclass
class _Slot:
    """One patched attribute: vLLM's original, the patches on it in order, what the registry last set."""

    owner: Any
    attribute: str
    original: Any
    inherited: bool  # the original lives on a base class: removing the last patch deletes the attribute
    hooks: list[tuple[Patch, Callable[[Any], Any]]] = field(default_factory=list)
    current: Any = None


def _parameters(obj: Any) -> tuple[str, ...]:
    fn = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
    return tuple(inspect.signature(fn).parameters)


class Registry:
    """The patches of this process. ``is_cpu`` and ``environ`` are injectable so that tests can stub the
    platform and the switches."""

    def __init__(self, is_cpu: Callable[[], bool] | None = None, environ: Mapping[str, str] | None = None):
        self._is_cpu = is_cpu or _vllm_platform_is_cpu
        self._environ = os.environ if environ is None else environ
        self._declared: dict[str, Patch] = {}
        self._states: dict[str, dict[str, str]] = {}
        self._slots: dict[tuple[int, str], _Slot] = {}
        self._where: dict[str, list[tuple[int, str]]] = {}  # a per-object patch may sit on several objects
        self._reads: list[TouchPoint] = []

    def reads(self, *points: TouchPoint) -> None:
        """Declare vLLM internals the package reads (listed and checked with the patches' targets)."""
        self._reads.extend(p for p in points if p not in self._reads)

    def touch_points(self, runner: str | None = None) -> list[TouchPoint]:
        """Every vLLM internal the package relies on: each patch's target, then every declared read;
        with ``runner`` (``v1`` or ``mrv2``) those a vLLM with that model runner must hold."""
        points = [p.touch_point() for p in sorted(self._declared.values(), key=lambda p: p.name)]
        unique: dict[tuple[str, str, str], TouchPoint] = {}
        for point in points + self._reads:
            unique.setdefault((point.file, point.name, point.kind), point)
        return [p for p in unique.values() if runner is None or p.runner in ("any", runner)]

    def patches(self) -> list[Patch]:
        return list(self._declared.values())

    def declare(self, patch: Patch) -> Patch:
        """Make a patch known (listed even if never installed); a second declaration of the name must
        be the same patch."""
        known = self._declared.get(patch.name)
        if known is not None and known != patch:
            raise PatchError(f"patch {patch.name} is declared twice with different contents")
        self._declared[patch.name] = patch
        self._states.setdefault(patch.name, {"state": "declared", "detail": "not asked to install"})
        return patch

    def gate(self, patch: Patch) -> str | None:
        """Why ``patch`` is not to be installed here, or None. Switch ``0``: off; ``1``: on (also off the
        CPU); unset: off for a shortcut under ``SHORTCUTS_SWITCH=0``, else by scope."""
        value = self._environ.get(patch.switch)
        if value == "0":
            return f"off ({patch.switch}=0)"
        if patch.shortcut and not value and self._environ.get(SHORTCUTS_SWITCH) == "0":
            return f"off ({SHORTCUTS_SWITCH}=0: every CPU shortcut whose own switch is unset)"
        if value == "1" or patch.scope == "everywhere":
            return None
        if self._is_cpu():
            return None
        return f"not installed off the CPU platform: {CPU_ONLY_NOTE} ({patch.switch}=1 switches it on)"

    def install(self, patch: Patch, wrap: Callable[[Any], Any], on: Any = None) -> str:
        """Install ``wrap(inner)`` over ``patch.target`` if it applies here; returns the state it ends in
        (``installed``, or ``skipped: <why>``). Raises ``PatchError`` for a second install of the name on
        the same owner or an attribute changed behind the registry's back; a missing target or a
        signature drift is a skip.

        ``on``: one object (a model runner) to patch instead of the target's class or module; the
        original is then that object's bound attribute, and uninstalling removes the override. Such a
        patch may be installed on several objects, once each."""
        self.declare(patch)
        if on is None and self.is_installed(patch.name):
            raise PatchError(f"patch {patch.name} is already installed on {patch.target}")
        reason = self.gate(patch)
        if reason:
            return self._set(patch, "skipped", reason)
        try:
            owner = _resolve_owner(patch) if on is None else on
            original = _original(owner, patch.attribute)
        except (ImportError, AttributeError) as exc:
            return self._set(patch, "skipped", f"{patch.target} not found in this vLLM ({exc!r})", logging.WARNING)
        key = (id(owner), patch.attribute)
        if key in self._where.get(patch.name, []):
            raise PatchError(f"patch {patch.name} is already installed on this {type(owner).__name__}")
        slot = self._slots.get(key)
        if slot is not None and _current(owner, patch.attribute) is not slot.current:
            raise PatchError(f"{patch.target} was changed outside the registry since it patched it")
        if slot is None:
            inherited = not isinstance(owner, types.ModuleType) and patch.attribute not in vars(owner)
            slot = _Slot(owner, patch.attribute, original, inherited)
        if patch.signature is not None:
            found = _parameters(slot.original)
            if found not in (patch.signature, *patch.also_checked):
                return self._set(patch, "skipped", f"signature drift: {patch.target} takes {list(found)}, "
                                 f"checked with {list(patch.signature)}", logging.WARNING)
        slot.hooks.append((patch, wrap))
        slot.hooks.sort(key=lambda hook: hook[0].order)
        self._slots[key] = slot
        self._where.setdefault(patch.name, []).append(key)
        self._rebuild(slot)
        return self._set(patch, "installed", "")

    def install_all(self, hooks: list[tuple[Patch, Callable[[Any], Any]]]) -> str:
        """Install patches that only work together, in order: all of them, or none (the ones already
        installed come off again when a later one does not apply); the state of the first that did not."""
        done = []
        for patch, wrap in hooks:
            result = self.install(patch, wrap)
            if result != "installed":
                for installed in reversed(done):
                    self.uninstall(installed.name)
                return result
            done.append(patch)
        return "installed"

    def skip(self, patch: Patch, reason: str) -> str:
        """Record that an installer left ``patch`` out here (the fault it fixes is absent, the feature is
        off); ``report()`` lists the reason."""
        self.declare(patch)
        if self.is_installed(patch.name):
            raise PatchError(f"patch {patch.name} is installed: uninstall it rather than skip it")
        return self._set(patch, "skipped", reason)

    def fail(self, name: str, error: BaseException) -> None:
        """Record that installing a declared patch raised (the installer's caller keeps vLLM running)."""
        if not self.is_installed(name):
            self._states[name] = {"state": "failed", "detail": repr(error)}

    def uninstall(self, name: str, on: Any = None) -> None:
        """Remove one patch (from ``on``, for a patch on several objects); the attribute returns to
        vLLM's own object once no patch is left on it."""
        key = self._key(name, on)
        slot = self._slots[key]
        if _current(slot.owner, slot.attribute) is not slot.current:
            raise PatchError(f"{self._declared[name].target} was changed outside the registry since it patched it")
        self._where[name].remove(key)
        slot.hooks = [hook for hook in slot.hooks if hook[0].name != name]
        if slot.hooks:
            self._rebuild(slot)
        else:
            if slot.inherited:
                delattr(slot.owner, slot.attribute)
            else:
                setattr(slot.owner, slot.attribute, slot.original)
            del self._slots[key]
        if not self._where[name]:
            del self._where[name]
            self._set(self._declared[name], "uninstalled", "")

    def original(self, name: str, on: Any = None) -> Any:
        """vLLM's own object under an installed patch (on ``on``, for a patch on several objects)."""
        return self._slots[self._key(name, on)].original

    def _key(self, name: str, on: Any) -> tuple[int, str]:
        keys = self._where.get(name, [])
        if on is not None:
            keys = [key for key in keys if key[0] == id(on)]
        if not keys:
            raise PatchError(f"patch {name} is not installed" + (" on that object" if on is not None else ""))
        if len(keys) > 1:
            raise PatchError(f"patch {name} is installed on {len(keys)} objects: say which (on=...)")
        return keys[0]

    def state(self, name: str) -> dict[str, str]:
        return dict(self._states[name])

    def is_installed(self, name: str) -> bool:
        return self._states.get(name, {}).get("state") == "installed"

    def report(self) -> list[dict[str, Any]]:
        """Every declared patch: name, state and its detail, target, scope, switch, checked on, why."""
        return [{"name": p.name, **self._states[p.name], "target": p.target, "scope": p.scope,
                 "switch": p.switch, "checked_on": list(p.checked_on), "why": p.why,
                 **({"repro": p.repro} if p.repro else {})} for p in self._declared.values()]

    def _rebuild(self, slot: _Slot) -> None:
        composed = slot.original
        for _, wrap in slot.hooks:
            inner, composed = composed, wrap(composed)
            _show_signature_of(composed, inner)
        setattr(slot.owner, slot.attribute, composed)
        slot.current = _current(slot.owner, slot.attribute)

    def _set(self, patch: Patch, state: str, detail: str, level: int = logging.DEBUG) -> str:
        self._states[patch.name] = {"state": state, "detail": detail}
        if state == "skipped":
            logger.log(level, "vllm-specrl patch %s skipped: %s", patch.name, detail)
        return f"{state}: {detail}" if detail else state


def _show_signature_of(wrapper: Any, inner: Any) -> None:
    """A wrapper taking ``(self, *args, **kwargs)`` shows the signature of what it wraps (``__wrapped__``,
    which ``inspect.signature`` follows), so a later patch's signature check, or a hook that binds the
    method's arguments by name, sees vLLM's parameters through it."""
    if wrapper is inner or isinstance(wrapper, (classmethod, staticmethod)) or hasattr(wrapper, "__wrapped__"):
        return
    try:
        params = inspect.signature(wrapper).parameters.values()
    except (TypeError, ValueError):
        return
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "self" for p in params):
        try:
            wrapper.__wrapped__ = inner
        except (AttributeError, TypeError):
            pass


def _current(owner: Any, attribute: str) -> Any:
    return vars(owner).get(attribute)


def _original(owner: Any, attribute: str) -> Any:
    """The attribute as a class or module stores it (a classmethod stays one); an instance's as it
    resolves (a bound method, or its own attribute)."""
    if isinstance(owner, (type, types.ModuleType)):
        return inspect.getattr_static(owner, attribute)
    return getattr(owner, attribute)


def _resolve_owner(patch: Patch) -> Any:
    module_name, owner_name = patch.owner_path
    owner = importlib.import_module(module_name)
    for part in filter(None, owner_name.split(".")):
        owner = getattr(owner, part)
    return owner


def _vllm_platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# This process's registry: the plugin installs through it and /specrl/status reports it.
REGISTRY = Registry()
