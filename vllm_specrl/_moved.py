"""Modules that moved, still importable by their old names (with a ``DeprecationWarning``).

Scripts, configs and pickles written against an earlier layout keep working: importing an old name
gives the module at its new place (the same object, so patching either patches both)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {  # old module -> new module
    "vllm_specrl.sync.worker_extension": "vllm_specrl.sync.worker.extension",
    "vllm_specrl.sync.reload": "vllm_specrl.sync.worker.reload",
    "vllm_specrl.sync.staging": "vllm_specrl.sync.worker.staging",
    "vllm_specrl.sync.validate": "vllm_specrl.sync.worker.validate",
    "vllm_specrl.sync.fingerprint": "vllm_specrl.sync.worker.fingerprint",
    "vllm_specrl.sync.routes": "vllm_specrl.sync.http.routes",
    "vllm_specrl.sync.guard": "vllm_specrl.sync.http.stale_guard",
    "vllm_specrl.sync.staged_engine": "vllm_specrl.sync.backends.staged",
    "vllm_specrl.sync.shm_engine": "vllm_specrl.sync.backends.shm_backend",
    "vllm_specrl.sync.gloo_engine": "vllm_specrl.sync.backends.gloo_backend",
    "vllm_specrl.sync.registration": "vllm_specrl.sync.backends.registration",
    "vllm_specrl.sync.weight_watch": "vllm_specrl.sync.watch.worker_loads",
    "vllm_specrl.sync.weight_events": "vllm_specrl.sync.watch.engine_core_events",
    "vllm_specrl.sync.native_api": "vllm_specrl.sync.watch.api_server",
    "vllm_specrl.sync.weight_watch_rpcs": "vllm_specrl.sync.watch.worker_rpcs",
    "vllm_specrl.sync.client": "vllm_specrl.sync.clients.engine_client",
    "vllm_specrl.sync.fleet": "vllm_specrl.sync.clients.fleet",
    "vllm_specrl.sync.engine_group": "vllm_specrl.sync.clients.engine_group",
    "vllm_specrl.sync.local": "vllm_specrl.sync.clients.llm",
    "vllm_specrl.routes": "vllm_specrl.sync.clients.response_check",
    "vllm_specrl.http": "vllm_specrl.endpoints",
    "vllm_specrl.server": "vllm_specrl.launcher",
    "vllm_specrl.adaptive.calibrate": "vllm_specrl.adaptive.k_sweep",
    "vllm_specrl.trainer.calibration": "vllm_specrl.trainer.estimate_check",
    # the CPU performance shortcuts, together
    "vllm_specrl.sampling": "vllm_specrl.cpu",
    "vllm_specrl.sampling.cpu_samplers": "vllm_specrl.cpu.samplers",
    "vllm_specrl.sampling.cpu_patches": "vllm_specrl.cpu.sampling_patches",
    "vllm_specrl.sampling.exact": "vllm_specrl.cpu.exact_sampling",
    "vllm_specrl.proposer.deferred_kv": "vllm_specrl.cpu.deferred_draft_kv",
    "vllm_specrl.proposer.draft_kv_stash": "vllm_specrl.cpu.draft_kv_stash",
    "vllm_specrl.adaptive.skip_draft_fetch": "vllm_specrl.cpu.skip_draft_fetch",
    "vllm_specrl.adaptive.step_timer": "vllm_specrl.cpu.step_timer",
    "vllm_specrl.compat.cpu_start_method": "vllm_specrl.cpu.start_method",
    "vllm_specrl.cpu_malloc": "vllm_specrl.cpu.malloc",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and hands back the module at its new place."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname: str, path, target=None):  # noqa: ANN001 - importlib's signature
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old name will be removed", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs[new] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module at its new place ran on import); give it back its own spec, which
        the import machinery overwrote with the old name's."""
        module.__spec__ = self._specs[module.__name__]


def install() -> None:
    """Make the old names importable (once per process)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
