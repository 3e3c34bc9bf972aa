"""Every switch a user can set is in ``vllm_specrl.switches`` (and so in the README's table): each
``VLLM_SPECRL_*`` name and each ``specrl`` ``--additional-config`` key the package reads, found in its
source; each registry patch's switch too. A switch set where it changes nothing is named by
``ineffective``. No engine starts here."""

from __future__ import annotations

import re
from pathlib import Path

import vllm_specrl
from vllm_specrl import patches  # noqa: F401 - declares every patch
from vllm_specrl.compat.registry import REGISTRY
from vllm_specrl.switches import ADAPTIVE_K_SCHEDULER, HISTORY_PROPOSER, SWITCHES, ineffective

PACKAGE = Path(vllm_specrl.__file__).parent
README = Path(__file__).resolve().parents[1] / "README.md"
ENV_NAME = re.compile(r"\bVLLM_SPECRL_[A-Z0-9_]+\b")
# ``cfg.get("key"`` / ``specrl_cfg.get("key"`` / ``specrl_additional_config(...).get("key"``
CONFIG_KEY = re.compile(r"(?:\bcfg|specrl_additional_config\([^)]*\))\.get\(\"([a-z_]+)\"")


def names_in_source(pattern: re.Pattern, root: Path = PACKAGE, reading: str = "") -> set[str]:
    """What ``pattern`` finds in the package's modules (those mentioning ``reading``, if given)."""
    found = set()
    for path in root.rglob("*.py"):
        text = path.read_text()
        if reading in text:
            found |= set(pattern.findall(text))
    return found


def test_every_environment_variable_the_package_reads_is_listed():
    listed = {s.name for s in SWITCHES if s.kind == "env"}
    missing = names_in_source(ENV_NAME) - listed
    assert not missing, f"switches missing from vllm_specrl/switches.py: {sorted(missing)}"


def test_every_additional_config_key_the_package_reads_is_listed():
    listed = {s.name for s in SWITCHES if s.kind == "config"}
    found = names_in_source(CONFIG_KEY, reading="specrl_additional_config")  # not the HF configs' reads
    assert {"adaptive_k", "capture", "history"} <= found  # the scan sees the keys
    assert not found - listed, f"config keys missing from vllm_specrl/switches.py: {sorted(found - listed)}"


def test_every_patch_switch_is_listed():
    listed = {s.name for s in SWITCHES}
    assert {p.switch for p in REGISTRY.patches()} <= listed


def test_the_scan_would_see_a_new_switch(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('import os\nos.environ.get("VLLM_SPECRL_PLANTED")\ncfg.get("planted_key", 1)\n')
    assert names_in_source(ENV_NAME, tmp_path) == {"VLLM_SPECRL_PLANTED"}
    assert names_in_source(CONFIG_KEY, tmp_path) == {"planted_key"}
    assert names_in_source(CONFIG_KEY, tmp_path, reading="specrl_additional_config") == set()


class _Spec:
    def __init__(self, method, model=None):
        self.method, self.model = method, model


def test_a_switch_without_effect_is_named_with_what_it_needs():
    eagle = _Spec("eagle3", "/draft")
    said = ineffective({"adaptive_k": {"explore": 0.05}}, None, eagle, environ={})
    assert len(said) == 1 and ADAPTIVE_K_SCHEDULER in said[0]
    assert ineffective({"adaptive_k": {}}, ADAPTIVE_K_SCHEDULER, eagle, environ={}) == []
    assert "nothing is speculated" in ineffective({"adaptive_k": {}}, ADAPTIVE_K_SCHEDULER, None, environ={})[0]
    assert "history index is not used" in ineffective({"history": {}}, None, eagle, environ={})[0]
    assert ineffective({"history": {}}, None, _Spec("custom_class", HISTORY_PROPOSER), environ={}) == []
    assert "capture_fraction" in ineffective({"capture_fraction": 0.5}, None, eagle, environ={})[0]
    assert ineffective({"capture": "tcp://127.0.0.1:5557", "capture_fraction": 0.5}, None, eagle, environ={}) == []
    assert "neither 0 nor 1" in ineffective({}, None, eagle, environ={"VLLM_SPECRL_FAST_SAMPLING": "off"})[0]
    assert ineffective({"drafter": {"on_damage": "report"}}, None, eagle, environ={}) == []
    history = _Spec("custom_class", HISTORY_PROPOSER)
    assert "no draft model to keep" in ineffective({"drafter": {}}, None, history, environ={})[0]


def test_the_server_reads_the_scheduler_and_proposer_off_vllms_config():
    from types import SimpleNamespace

    from vllm_specrl.adaptive.scheduler import AdaptiveKScheduler
    from vllm_specrl.endpoints import ineffective_switches

    def config(scheduler_cls):
        return SimpleNamespace(scheduler_config=SimpleNamespace(scheduler_cls=scheduler_cls),
                               speculative_config=_Spec("eagle3", "/draft"),
                               additional_config={"specrl": {"adaptive_k": {"explore": 0.05}}})

    assert ADAPTIVE_K_SCHEDULER in ineffective_switches(config(None))[0]
    assert ineffective_switches(config(ADAPTIVE_K_SCHEDULER)) == []
    assert ineffective_switches(config(AdaptiveKScheduler)) == []  # vLLM may hold the class itself
