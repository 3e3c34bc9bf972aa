"""``VLLM_SPECRL_CPU_START_METHOD=fork``: vLLM's CPU engine core and worker forked, not spawned.

vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unconditionally in
``check_and_update_config``, so ``vllm serve`` starts three processes that each import vLLM
(about 14 s apiece on 2 cores). Off unless asked for: a CPU start-up cost, not a fault.
"""

from __future__ import annotations

import os

from vllm_specrl.compat.registry import REGISTRY, Patch

CPU_START_METHOD_ENV = "VLLM_SPECRL_CPU_START_METHOD"
_START_METHODS = ("fork", "spawn")
START_METHOD_PATCH = REGISTRY.declare(Patch(shortcut=True,
    name="cpu_start_method", target="vllm.platforms.cpu:CpuPlatform.check_and_update_config",
    why="puts VLLM_SPECRL_CPU_START_METHOD back after the CPU platform forces spawn: forked engine "
        "processes skip re-importing vLLM (CPU start-up: 47 s to a ready tiny-model server, 20 s forked)",
    scope="cpu", switch=CPU_START_METHOD_ENV, checked_on=("vLLM 0.32.0, CPU",), signature=("cls", "vllm_config")))


def requested_cpu_start_method() -> str | None:
    """``VLLM_SPECRL_CPU_START_METHOD`` (``fork`` or ``spawn``), or None when unset; anything else is an error."""
    method = os.environ.get(CPU_START_METHOD_ENV, "").strip().lower() or None
    if method is not None and method not in _START_METHODS:
        raise ValueError(f"{CPU_START_METHOD_ENV}={method!r}: expected one of {_START_METHODS}")
    return method


def _reload_plugins_in_forked_child() -> None:
    """vLLM loads general plugins once per process (``vllm.plugins.plugins_loaded``); a forked child
    inherits the flag set, so its own ``load_general_plugins()`` (engine core, worker start-up) would
    skip the plugin and the worker would run without its worker-side fixes. Clear it in the child."""
    import vllm.plugins

    vllm.plugins.plugins_loaded = False


def install_cpu_start_method() -> str:
    """Let ``VLLM_SPECRL_CPU_START_METHOD=fork`` start the engine core and its worker by fork on CPU.

    vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unconditionally in
    ``check_and_update_config``, so ``vllm serve`` starts three processes that each import vLLM
    (about 14 s apiece on 2 cores: 47 s to a ready tiny-model server, 20 s forked). The wrap puts the
    requested method back after the platform's check; vLLM's own reasons to force spawn
    (``_maybe_force_spawn``: Ray, NUMA binding) still apply after it. Unset: vLLM's behaviour."""
    method = requested_cpu_start_method()
    if REGISTRY.is_installed(START_METHOD_PATCH.name):
        return f"engine processes started by {method}"
    if method is None:
        return REGISTRY.skip(START_METHOD_PATCH, "not requested (vLLM's default: spawn on CPU)")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return REGISTRY.skip(START_METHOD_PATCH, "not needed (not the CPU platform)")

    def wrap(stock: classmethod) -> classmethod:
        def check_and_update_config(cls, vllm_config):
            stock.__func__(cls, vllm_config)
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method
        return classmethod(check_and_update_config)

    result = REGISTRY.install(START_METHOD_PATCH, wrap)
    if result != "installed":
        return result
    os.register_at_fork(after_in_child=_reload_plugins_in_forked_child)
    return f"engine processes started by {method}"
