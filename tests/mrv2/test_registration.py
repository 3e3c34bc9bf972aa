"""The port's wiring on any vLLM: what the plugin registers and installs for Model Runner V2, the version
gate, capture on a runner whose speculator cannot tee, and a declined vLLM refusing the package's features.
vLLM 0.34 itself is not installed here: its registry is a stand-in that records calls; the classes the
registration names are read from the package's source (``make check-vllm`` imports them in vLLM 0.34)."""

from __future__ import annotations

import ast
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_specrl import patches, plugin
from vllm_specrl.capture import runner_hooks
from vllm_specrl.compat import version
from vllm_specrl.mrv2 import registration
from vllm_specrl.mrv2.capture_view import CaptureTee

PACKAGE = Path(registration.__file__).resolve().parents[1]


def test_on_a_vllm_without_the_registry_nothing_is_registered():
    assert not registration.has_speculator_registry()   # vLLM 0.32 here
    assert registration.register_speculative_methods().startswith("not needed")


def test_every_method_is_registered_by_a_qualified_name_that_exists(monkeypatch):
    calls = []
    module = types.ModuleType("vllm.v1.worker.gpu.spec_decode.speculator_config")
    module.register_speculative_method = lambda name, config: calls.append((name, config))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    import vllm.v1.worker.gpu.spec_decode as parent
    monkeypatch.setattr(parent, "speculator_config", module, raising=False)
    assert registration.has_speculator_registry()
    assert registration.register_speculative_methods() == "registered specrl_eagle3, specrl_mtp, specrl_history"
    assert dict(calls) == registration.METHODS
    for qualname in registration.METHODS.values():
        module_name, _, cls = qualname.rpartition(".")
        source = PACKAGE.parent / (module_name.replace(".", "/") + ".py")
        classes = {n.name: n for n in ast.parse(source.read_text()).body if isinstance(n, ast.ClassDef)}
        assert cls in classes, qualname
        speculator = next(ast.literal_eval(v.value) if isinstance(v.value, ast.Constant) else v.value
                          for v in classes[cls].body if isinstance(v, ast.Assign)
                          and v.targets[0].id == "speculator_class")
        if not isinstance(speculator, str):   # f"{_SPECULATORS}.Name"
            speculator = "vllm_specrl.mrv2.speculators." + speculator.values[-1].value.lstrip(".")
        spec_module, _, spec_cls = speculator.rpartition(".")
        spec_source = PACKAGE.parent / (spec_module.replace(".", "/") + ".py")
        assert spec_cls in {n.name for n in ast.parse(spec_source.read_text()).body if isinstance(n, ast.ClassDef)}


def test_model_runner_v2_gets_what_carries_over_and_is_told_what_does_not():
    every, left_out = patches.steps_for("v1", runs_model=True)
    assert left_out == [] and {s.key for s in every} >= patches.MRV2_STEPS
    kept, left_out = patches.steps_for("mrv2", runs_model=True)
    assert {s.key for s in kept} == patches.MRV2_STEPS
    assert {s.key for s in left_out} == {s.key for s in every} - patches.MRV2_STEPS
    assert "cpu_fast_sampling" in {s.key for s in left_out}
    kept, _ = patches.steps_for("mrv2", runs_model=False)   # an API server: no worker steps
    assert "weight_watch" not in {s.key for s in kept} and "speculative_methods" in {s.key for s in kept}


def test_the_version_gate_takes_0_34_as_written_not_run():
    assert version.is_supported("0.34.0") and version.is_supported("0.34.2+cu130")
    assert not version.is_supported("0.35.0") and not version.is_supported("0.31.1")
    assert "not run" in version.validation("0.34.0")
    with pytest.raises(version.UnsupportedVLLMVersion, match="0.34.x through the Model Runner V2 port"):
        version.check_supported("0.35.0")


def test_a_declined_vllm_refuses_the_packages_features(monkeypatch):
    monkeypatch.setattr(plugin, "_state", {"status": "declined", "pid": os.getpid(), "reason": "vLLM 0.35.0 is "
                                           "outside >=0.32,<0.35"})
    with pytest.raises(plugin.PluginDeclined, match="0.35.0"):
        plugin.require_active()
    monkeypatch.setattr(plugin, "_state", {"status": "active", "pid": os.getpid()})
    plugin.require_active()


def test_capture_on_model_runner_v2_uses_the_speculators_tee_or_says_which_method_can():
    tee = CaptureTee()
    runner = SimpleNamespace(speculator=SimpleNamespace(specrl_capture=tee))
    tap = object()
    assert runner_hooks.install_capture_tap(runner, tap).startswith("installed")
    assert tee.tap is tap and runner_hooks.speculator_tee(runner) is tee
    assert runner_hooks.install_capture_tap(runner, tap) == "replaced"
    runner_hooks.remove_capture_tap(runner)
    assert tee.tap is None
    plain = SimpleNamespace(speculator=SimpleNamespace(), speculative_config=SimpleNamespace(method="eagle3"))
    with pytest.raises(runner_hooks.CaptureUnavailable, match="specrl_eagle3.*not 'eagle3'"):
        runner_hooks.install_capture_tap(plain, tap)
