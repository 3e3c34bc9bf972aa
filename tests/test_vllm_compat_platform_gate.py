"""Step shortcuts justified by CPU measurements are installed on the CPU platform only: on another
platform (stubbed here) they leave vLLM's classes untouched unless their switch says 1, and their
switch says 0 to keep vLLM's path on the CPU too. No engine starts here."""

from __future__ import annotations

import pytest
from vllm.platforms import current_platform
from vllm.v1.engine.core import EngineCore
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_specrl import vllm_compat
from vllm_specrl.vllm_compat import (DEFER_DRAFT_KV_ENV, SKIP_EMPTY_DRAFT_FETCH_ENV, ZERO_DRAFT_ENV,
                                     cpu_measured_gate)

GATED = [(ZERO_DRAFT_ENV, vllm_compat.install_zero_draft_plain_sampler),
         (SKIP_EMPTY_DRAFT_FETCH_ENV, vllm_compat.install_skip_empty_draft_fetch),
         (DEFER_DRAFT_KV_ENV, vllm_compat.install_deferred_draft_kv)]


@pytest.fixture
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "device_name", "cuda")
    for switch, _ in GATED:
        monkeypatch.delenv(switch, raising=False)


def _patched_attributes() -> dict:
    return {"_sample": GPUModelRunner.__dict__["_sample"],
            "propose_draft_token_ids": GPUModelRunner.__dict__["propose_draft_token_ids"],
            "post_step": EngineCore.__dict__["post_step"]}


@pytest.mark.parametrize("switch, install", GATED, ids=[s for s, _ in GATED])
def test_off_the_cpu_a_shortcut_is_not_installed_and_says_how_to_switch_it_on(on_a_gpu, switch, install):
    before = _patched_attributes()
    result = install()
    assert "not installed on cuda" in result and f"{switch}=1" in result and vllm_compat.CPU_MEASURED_NOTE in result
    assert _patched_attributes() == before


def test_the_gate_follows_platform_and_switch(monkeypatch):
    monkeypatch.delenv(ZERO_DRAFT_ENV, raising=False)
    assert cpu_measured_gate(ZERO_DRAFT_ENV) is None  # the CPU platform: on by default
    monkeypatch.setenv(ZERO_DRAFT_ENV, "0")
    assert cpu_measured_gate(ZERO_DRAFT_ENV) == f"off ({ZERO_DRAFT_ENV}=0)"
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert cpu_measured_gate(ZERO_DRAFT_ENV) == f"off ({ZERO_DRAFT_ENV}=0)"
    monkeypatch.setenv(ZERO_DRAFT_ENV, "1")
    assert cpu_measured_gate(ZERO_DRAFT_ENV) is None  # switched on explicitly off the CPU
    monkeypatch.delenv(ZERO_DRAFT_ENV)
    assert cpu_measured_gate(ZERO_DRAFT_ENV) is not None
