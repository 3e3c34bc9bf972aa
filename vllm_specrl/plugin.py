"""The ``vllm.general_plugins`` entry point.

vLLM calls it once in every process it starts: the API server (front end),
the engine core and every worker. It must be idempotent and cheap, must never
break vLLM, and declines with one clear warning on a vLLM it was not checked
against. Its per-process state is what ``/specrl/status`` reports, which
makes "the plugin reached the worker" observable rather than assumed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from typing import Any

from vllm_specrl import cpu_malloc, vllm_compat
from vllm_specrl._log import log_early
from vllm_specrl._version import __version__
from vllm_specrl.compat.registry import CPU_ONLY_NOTE, REGISTRY

_lock = threading.Lock()
_state: dict[str, Any] = {"status": "not-loaded"}
# The process that imported this module: a process with another pid that finds it imported was
# forked from it (VLLM_SPECRL_CPU_START_METHOD=fork) rather than started as a new interpreter.
_IMPORTED_IN_PID = os.getpid()


def process_role() -> str:
    """Which vLLM process this is, from the names vLLM gives its processes."""
    name = multiprocessing.current_process().name
    if name.startswith("EngineCore"):
        return "engine_core"
    if name.startswith("VllmWorker"):
        return "worker"
    return "main"


def state() -> dict[str, Any]:
    """This process's plugin state (a copy)."""
    return dict(_state)


def _install_registrations() -> list[str]:
    """Everything the plugin installs, each guarded: a failure is logged, never raised."""
    steps = [("model_architecture", "EAGLE-3 draft architecture", vllm_compat.register_eagle3_architecture),
             ("cpu_expand_kernel_fix", "CPU expand-kernel fix", vllm_compat.install_cpu_expand_fix),
             ("weight_transfer_backend", "specrl_shm weight-transfer backend",
              vllm_compat.register_shm_weight_transfer_backend),
             ("cpu_start_method", "engine start method on CPU", vllm_compat.install_cpu_start_method)]
    if _runs_model_here():
        steps.append(("cpu_malloc_tuning", "glibc malloc thresholds (CPU)", _tune_malloc_on_cpu))
        steps.append(("cpu_seeded_rewind_fix", "CPU seeded-rewind fix",
                      vllm_compat.install_cpu_seeded_rewind_fix))
        steps.append(("cpu_fast_sampling", "CPU inverse-CDF spec-decode sampling",
                      vllm_compat.install_cpu_fast_sampling))
        steps.append(("zero_draft_plain_sampler", "plain sampler for steps without drafts",
                      vllm_compat.install_zero_draft_plain_sampler))
        steps.append(("runner_step_timer", "model-runner step timer (adaptive k)",
                      vllm_compat.install_runner_step_timer))
        steps.append(("deferred_draft_kv", "deferred draft-KV sync at k = 0",
                      vllm_compat.install_deferred_draft_kv))
        steps.append(("skip_empty_draft_fetch", "no draft fetch after steps without drafts",
                      vllm_compat.install_skip_empty_draft_fetch))
        steps.append(("custom_proposer_binding", "runner batch for custom_class proposers (history)",
                      vllm_compat.install_custom_proposer_binding))
    done = []
    for key, what, install in steps:
        try:
            result = install()
        except Exception as exc:  # noqa: BLE001 - the plugin must never break vLLM
            log_early(logging.WARNING, "vllm-specrl: %s not installed: %r", what, exc)
            result = f"failed ({exc!r})"
        done.append(f"{key}: {result}")
    gated = [f"{row['name']} ({row['switch']}=1 switches it on)" for row in REGISTRY.report()
             if row["state"] == "skipped" and CPU_ONLY_NOTE in row["detail"]]
    if gated:
        log_early(logging.INFO, "vllm-specrl: left vLLM's own path for step shortcuts %s: %s",
                  CPU_ONLY_NOTE, "; ".join(gated))
    return done


def _tune_malloc_on_cpu() -> str:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not needed (not the CPU platform)"
    return cpu_malloc.tune_glibc_malloc()


def _runs_model_here() -> bool:
    """Worker-side fixes import the model runner: skip that in a pure API-server process."""
    if process_role() != "main":
        return True
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def register() -> None:
    """Entry point: check the vLLM version, then install registrations once."""
    with _lock:
        if _state.get("pid") not in (None, os.getpid()):
            # A forked engine core or worker (VLLM_SPECRL_CPU_START_METHOD=fork) inherits its
            # parent's state; its role and its worker-side registrations are its own.
            _state.clear()
            _state["status"] = "not-loaded"
        if _state["status"] in ("active", "declined"):
            return
        role, pid = process_role(), os.getpid()
        version = vllm_compat.vllm_version()
        if not vllm_compat.is_supported(version):
            _state.update(status="declined", role=role, pid=pid, vllm=version,
                          reason=f"vLLM {version} is outside {vllm_compat.SUPPORTED_RANGE}")
            log_early(
                logging.WARNING,
                "vllm-specrl %s supports vLLM %s (0.32.x and 0.33.x) but found %s: "
                "the plugin registers nothing and vLLM runs unchanged",
                __version__, vllm_compat.SUPPORTED_RANGE, version)
            return
        _state.update(status="active", role=role, pid=pid, vllm=version, forked=pid != _IMPORTED_IN_PID,
                      vllm_specrl=__version__, registrations=_install_registrations(), patches=REGISTRY.report())
        log_early(logging.INFO, "vllm-specrl %s plugin active in %s process (pid %d, vLLM %s)",
                    __version__, role, pid, version)
