"""The registered patches on vLLM's own classes, in this process: step shortcuts justified by CPU
measurements leave vLLM untouched off the CPU (platform stubbed) unless their switch says 1; a patch
needed everywhere installs off the CPU too, composes with the others on the same method in its order,
and uninstalling puts vLLM's own method back. No engine starts here."""

from __future__ import annotations

import pytest
from vllm.platforms import current_platform
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_specrl.cpu import skip_draft_fetch
from vllm_specrl.compat.registry import CPU_ONLY_NOTE, REGISTRY
from vllm_specrl.proposer import custom_binding, deferred_kv
from vllm_specrl.cpu import sampling_patches as cpu_patches

CPU_SCOPED = [(cpu_patches.ZERO_DRAFT_ENV, cpu_patches.install_zero_draft_plain_sampler,
               cpu_patches.ZERO_DRAFT_PATCH),
              (skip_draft_fetch.SKIP_EMPTY_DRAFT_FETCH_ENV, skip_draft_fetch.install_skip_empty_draft_fetch,
               skip_draft_fetch.SKIP_FETCH_POST_STEP_PATCH),
              (deferred_kv.DEFER_DRAFT_KV_ENV, deferred_kv.install_deferred_draft_kv, deferred_kv.DEFERRED_KV_PATCH)]


def _vllm_attributes() -> dict:
    return {"_sample": GPUModelRunner.__dict__["_sample"],
            "propose_draft_token_ids": GPUModelRunner.__dict__["propose_draft_token_ids"],
            "post_step": EngineCore.__dict__["post_step"], "schedule": Scheduler.__dict__["schedule"]}


ON_THESE_ATTRIBUTES = [patch.name for _, _, patch in CPU_SCOPED] + [
    skip_draft_fetch.SKIP_FETCH_SCHEDULE_PATCH.name, custom_binding.CUSTOM_BINDING_PATCH.name]


@pytest.fixture
def pristine():
    """No patch on these vLLM attributes is installed in this process before or after a test."""
    assert not any(REGISTRY.is_installed(name) for name in ON_THESE_ATTRIBUTES)
    before = _vllm_attributes()
    yield before
    for name in ON_THESE_ATTRIBUTES:
        if REGISTRY.is_installed(name):
            REGISTRY.uninstall(name)
    assert _vllm_attributes() == before


@pytest.fixture
def on_a_gpu(monkeypatch, pristine):
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    for switch, _, _ in CPU_SCOPED:
        monkeypatch.delenv(switch, raising=False)
    return pristine


@pytest.mark.parametrize("switch, install, patch", CPU_SCOPED, ids=[s for s, _, _ in CPU_SCOPED])
def test_off_the_cpu_a_shortcut_is_not_installed_and_says_how_to_switch_it_on(on_a_gpu, switch, install, patch):
    result = install()
    assert CPU_ONLY_NOTE in result and f"{switch}=1" in result
    assert _vllm_attributes() == on_a_gpu
    assert REGISTRY.state(patch.name)["state"] == "skipped"


@pytest.mark.parametrize("switch, install, patch", CPU_SCOPED, ids=[s for s, _, _ in CPU_SCOPED])
def test_switched_on_it_installs_off_the_cpu_and_comes_off_again(on_a_gpu, monkeypatch, switch, install, patch):
    monkeypatch.setenv(switch, "1")
    assert install().startswith("installed")
    assert _vllm_attributes() != on_a_gpu
    assert install() == "installed"  # a second call (a forked child's plugin) changes nothing


def test_on_the_cpu_a_switch_at_0_keeps_vllms_path(pristine, monkeypatch):
    monkeypatch.setenv(cpu_patches.ZERO_DRAFT_ENV, "0")
    assert cpu_patches.install_zero_draft_plain_sampler() == f"skipped: off ({cpu_patches.ZERO_DRAFT_ENV}=0)"
    assert _vllm_attributes() == pristine


def test_the_binding_runs_everywhere_and_wraps_outside_the_deferral_whatever_the_install_order(on_a_gpu, monkeypatch):
    monkeypatch.setenv(deferred_kv.DEFER_DRAFT_KV_ENV, "1")
    original = on_a_gpu["propose_draft_token_ids"]
    assert custom_binding.install_custom_proposer_binding() == "installed"  # scope "everywhere": no switch needed
    assert deferred_kv.install_deferred_draft_kv().startswith("installed")
    outer = GPUModelRunner.__dict__["propose_draft_token_ids"]
    inner = outer.__wrapped__
    assert "bind_step" in outer.__code__.co_consts and "_specrl_deferred_kv" in inner.__code__.co_names
    assert inner.__wrapped__ is original
    REGISTRY.uninstall(custom_binding.CUSTOM_BINDING_PATCH.name)
    assert GPUModelRunner.__dict__["propose_draft_token_ids"].__wrapped__ is original
