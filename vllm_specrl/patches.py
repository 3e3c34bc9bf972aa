"""Every engine patch and registration of the package, in the order the plugin installs them.

Importing this module declares every patch in ``compat.registry.REGISTRY`` (each feature declares
its own beside its code), which is what ``/specrl/status``, ``vllm-specrl doctor`` and the touch-point
check list. ``WORKER`` steps import vLLM's model runner, so they run only where a model runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

# The import order is the declaration order, which is the order doctor and /specrl/status list the patches in.
from vllm_specrl.cpu import malloc as cpu_malloc
from vllm_specrl.cpu.skip_draft_fetch import (SKIP_FETCH_POST_STEP_PATCH, SKIP_FETCH_SCHEDULE_PATCH,
                                              install_skip_empty_draft_fetch)
from vllm_specrl.cpu.step_timer import STEP_TIMER_EXECUTE_PATCH, STEP_TIMER_SAMPLE_PATCH, install_runner_step_timer
from vllm_specrl.capture import runner_hooks  # noqa: F401 - declares the tap's and recorder's patches
from vllm_specrl.compat import touch_points  # noqa: F401 - declares the internals read without patching
from vllm_specrl.compat.cpu_expand_kernel import EXPAND_KERNEL_PATCH, install_cpu_expand_fix
from vllm_specrl.compat.cpu_seeded_rewind import SEEDED_REWIND_PATCH, install_cpu_seeded_rewind_fix
from vllm_specrl.cpu.start_method import START_METHOD_PATCH, install_cpu_start_method
from vllm_specrl.proposer.custom_binding import CUSTOM_BINDING_PATCH, install_custom_proposer_binding
from vllm_specrl.cpu.deferred_draft_kv import DEFERRED_KV_PATCH, install_deferred_draft_kv
from vllm_specrl.compat.registry import REGISTRY
from vllm_specrl.lifecycle.engine_core import POST_STEP_PATCH, install_drafter_lifecycle
from vllm_specrl.mrv2 import touch_points as mrv2_touch_points  # noqa: F401 - declares the port's reads
from vllm_specrl.mrv2.registration import register_speculative_methods
from vllm_specrl.proposer.eagle3_config import register_eagle3_architecture
from vllm_specrl.cpu.sampling_patches import (FAST_SAMPLING_PATCHES, ZERO_DRAFT_METADATA_PATCH, ZERO_DRAFT_PATCH,
                                              install_cpu_fast_sampling, install_zero_draft_plain_sampler)
from vllm_specrl.sync.backends.registration import (register_gloo_weight_transfer_backend,
                                                    register_shm_weight_transfer_backend)
from vllm_specrl.sync.watch.engine_core_events import LABEL_PATCH, RPC_PATCH, WAKE_PATCH, install_weight_events
from vllm_specrl.sync.watch.worker_loads import (FINISH_PATCH, LOAD_MODEL_PATCH, RELOAD_PATCH, START_DRAFT_PATCH,
                                                 START_PATCH, UPDATE_PATCH, install_weight_watch)
from vllm_specrl.sync.watch import api_server  # noqa: F401 - declares the API server's per-client patches

class Step(NamedTuple):
    key: str
    what: str
    install: Callable[[], str]
    patches: tuple[str, ...] = ()  # the registry's patches it installs (marked failed if it raises)


def install_step(step: Step) -> str:
    """Run one step; an exception is recorded against its patches and returned, never raised."""
    try:
        return step.install()
    except Exception as exc:  # noqa: BLE001 - the plugin must never break vLLM
        for name in step.patches:
            REGISTRY.fail(name, exc)
        return f"failed ({exc!r})"


def _tune_malloc_on_cpu() -> str:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not needed (not the CPU platform)"
    return cpu_malloc.tune_glibc_malloc()


# Every process vLLM starts (the API server too).
EVERY_PROCESS = (
    Step("model_architecture", "EAGLE-3 draft architecture", register_eagle3_architecture),
    Step("cpu_expand_kernel_fix", "CPU expand-kernel fix", install_cpu_expand_fix, (EXPAND_KERNEL_PATCH.name,)),
    Step("weight_transfer_backend", "specrl_shm weight-transfer backend", register_shm_weight_transfer_backend),
    Step("gloo_weight_transfer_backend", "specrl_gloo weight-transfer backend (worker and trainer)",
         register_gloo_weight_transfer_backend),
    Step("cpu_start_method", "engine start method on CPU", install_cpu_start_method, (START_METHOD_PATCH.name,)),
    Step("speculative_methods", "specrl_eagle3 / specrl_mtp / specrl_history speculative methods (Model Runner V2)",
         register_speculative_methods),
)
# Processes that run a model (engine core, workers, or an in-process engine).
WORKER = (
    Step("cpu_malloc_tuning", "glibc malloc thresholds (CPU)", _tune_malloc_on_cpu),
    Step("cpu_seeded_rewind_fix", "CPU seeded-rewind fix", install_cpu_seeded_rewind_fix,
         (SEEDED_REWIND_PATCH.name,)),
    Step("cpu_fast_sampling", "CPU inverse-CDF spec-decode sampling", install_cpu_fast_sampling,
         tuple(patch.name for patch, _ in FAST_SAMPLING_PATCHES)),
    Step("zero_draft_plain_sampler", "plain sampler and metadata for steps without drafts",
         install_zero_draft_plain_sampler, (ZERO_DRAFT_PATCH.name, ZERO_DRAFT_METADATA_PATCH.name)),
    Step("runner_step_timer", "model-runner step timer (adaptive k)", install_runner_step_timer,
         (STEP_TIMER_EXECUTE_PATCH.name, STEP_TIMER_SAMPLE_PATCH.name)),
    Step("deferred_draft_kv", "deferred draft-KV sync at k = 0", install_deferred_draft_kv, (DEFERRED_KV_PATCH.name,)),
    Step("skip_empty_draft_fetch", "no draft fetch after steps without drafts", install_skip_empty_draft_fetch,
         (SKIP_FETCH_POST_STEP_PATCH.name, SKIP_FETCH_SCHEDULE_PATCH.name)),
    Step("custom_proposer_binding", "runner batch for custom_class proposers (history)",
         install_custom_proposer_binding, (CUSTOM_BINDING_PATCH.name,)),
    Step("weight_watch", "every load into the served models watched (worker)", install_weight_watch,
         tuple(p.name for p in (START_PATCH, START_DRAFT_PATCH, UPDATE_PATCH, FINISH_PATCH, RELOAD_PATCH,
                                LOAD_MODEL_PATCH))),
    Step("weight_events", "weight changes turned into versions (engine core)", install_weight_events,
         (RPC_PATCH.name, LABEL_PATCH.name, WAKE_PATCH.name)),
    Step("drafter_lifecycle", "drafter checks, repairs and the collapse alarm between steps (engine core)",
         install_drafter_lifecycle, (POST_STEP_PATCH.name,)),
)

# What carries over to Model Runner V2 (vLLM >= 0.34): registrations, the weight watch on the worker and
# the engine core's events and lifecycle (their vLLM methods are unchanged). The rest patches the V1 runner,
# its sampler and proposers (removed in 0.34) or the CPU platform (no CPU build of 0.34 exists); the
# registered speculators serve instead (docs/vllm-0.34-port-map.md).
MRV2_STEPS = frozenset({"model_architecture", "weight_transfer_backend", "gloo_weight_transfer_backend",
                        "speculative_methods", "weight_watch", "weight_events", "drafter_lifecycle"})


def steps_for(runner: str, runs_model: bool) -> tuple[list[Step], list[Step]]:
    """(the steps to install, the steps left out as not ported) for a vLLM whose speculators run on
    ``runner`` (``v1`` or ``mrv2``), in a process that runs a model or not."""
    steps = list(EVERY_PROCESS) + (list(WORKER) if runs_model else [])
    if runner != "mrv2":
        return steps, []
    return [s for s in steps if s.key in MRV2_STEPS], [s for s in steps if s.key not in MRV2_STEPS]
