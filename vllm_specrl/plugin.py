"""The ``vllm.general_plugins`` entry point.

vLLM calls it once in every process it starts: the API server (front end),
the engine core and every worker. It must be idempotent and cheap, must never
break vLLM, and declines with one clear warning on a vLLM it was not checked
against. Its per-process state is what ``/specrl/status`` reports, which
makes "the plugin reached the worker" observable rather than assumed.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from vllm_specrl._log import log_early
from vllm_specrl._version import __version__
from vllm_specrl.adaptive import calibration_ids
from vllm_specrl.compat import version as vllm_versions
from vllm_specrl.compat.engine_config import process_role
from vllm_specrl.compat.registry import CPU_ONLY_NOTE, REGISTRY

_lock = threading.Lock()
_state: dict[str, Any] = {"status": "not-loaded"}
# The process that imported this module: a process with another pid that finds it imported was
# forked from it (VLLM_SPECRL_CPU_START_METHOD=fork) rather than started as a new interpreter.
_IMPORTED_IN_PID = os.getpid()


def state() -> dict[str, Any]:
    """This process's plugin state (a copy), with every patch's state as it is now (a capture tap
    installed on a runner since start-up shows as installed)."""
    current = dict(_state)
    if current.get("status") == "active":
        current["patches"] = REGISTRY.report()
    return current


def _install_registrations(runner: str) -> list[str]:
    """Everything the plugin installs (``vllm_specrl.patches``), each guarded: a failure is logged, never
    raised."""
    from vllm_specrl import patches
    steps, not_ported = patches.steps_for(runner, _runs_model_here())
    done = [f"{step.key}: not ported to Model Runner V2 (a V1-runner or CPU-only patch)" for step in not_ported]
    for step in steps:
        result = patches.install_step(step)
        if result.startswith("failed"):
            log_early(logging.WARNING, "vllm-specrl: %s not installed: %s", step.what, result)
        done.append(f"{step.key}: {result}")
    gated = [f"{row['name']} ({row['switch']}=1 switches it on)" for row in REGISTRY.report()
             if row["state"] == "skipped" and CPU_ONLY_NOTE in row["detail"]]
    if gated:
        log_early(logging.INFO, "vllm-specrl: left vLLM's own path for step shortcuts %s: %s",
                  CPU_ONLY_NOTE, "; ".join(gated))
    return done


def _platform() -> str:
    """vLLM's platform in this process (``cpu``, ``cuda``, ...), as the patches' scopes read it."""
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type)
    except Exception as exc:  # noqa: BLE001 - status must never break the plugin
        return f"unknown ({exc!r})"


def _runs_model_here() -> bool:
    """Worker-side fixes import the model runner: skip that in a pure API-server process."""
    if process_role() != "main":
        return True
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def register() -> None:
    """Entry point: check the vLLM version, then install registrations once."""
    calibration_ids.ensure_token()  # before vLLM starts its engine processes: they inherit it
    with _lock:
        if _state.get("pid") not in (None, os.getpid()):
            # A forked engine core or worker (VLLM_SPECRL_CPU_START_METHOD=fork) inherits its
            # parent's state; its role and its worker-side registrations are its own.
            _state.clear()
            _state["status"] = "not-loaded"
        if _state["status"] in ("active", "declined"):
            return
        role, pid = process_role(), os.getpid()
        version = vllm_versions.vllm_version()
        if not vllm_versions.is_supported(version):
            _state.update(status="declined", role=role, pid=pid, vllm=version,
                          reason=f"vLLM {version} is outside {vllm_versions.SUPPORTED_RANGE}")
            log_early(
                logging.WARNING,
                "vllm-specrl %s supports vLLM %s (%s) but found %s: the plugin registers nothing and "
                "vLLM runs unchanged; the package's methods, routes and worker extension refuse to run",
                __version__, vllm_versions.SUPPORTED_RANGE, vllm_versions.SUPPORTED_TEXT, version)
            return
        from vllm_specrl.mrv2.registration import has_speculator_registry

        runner = "mrv2" if has_speculator_registry() else "v1"
        _state.update(status="active", role=role, pid=pid, vllm=version, platform=_platform(),
                      forked=pid != _IMPORTED_IN_PID, model_runner=runner,
                      validation=vllm_versions.validation(version),
                      vllm_specrl=__version__, registrations=_install_registrations(runner))
        log_early(logging.INFO, "vllm-specrl %s plugin active in %s process (pid %d, vLLM %s)",
                    __version__, role, pid, version)


class PluginDeclined(RuntimeError):
    """A feature of the package was asked for on a vLLM the plugin declined."""


def require_active() -> None:
    """Raise where the plugin declined this process's vLLM: a feature asked for there must fail with the
    reason, never run half-installed (a weight update without its watch, capture without its tap)."""
    if _state.get("status") == "declined" and _state.get("pid") == os.getpid():
        raise PluginDeclined(f"vllm-specrl {__version__}: {_state.get('reason')}; install a vLLM in "
                             f"{vllm_versions.SUPPORTED_RANGE} ({vllm_versions.SUPPORTED_TEXT})")
