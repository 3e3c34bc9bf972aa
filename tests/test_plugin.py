import logging

import pytest

from vllm_specrl import plugin
from vllm_specrl.compat import version as vllm_versions


@pytest.fixture
def fresh_plugin_state(monkeypatch):
    monkeypatch.setattr(plugin, "_state", {"status": "not-loaded"})
    yield


def _logged(caplog, capsys) -> list[str]:
    """Lines the plugin logged, through vLLM's logger or the early stderr path."""
    return [r.getMessage() for r in caplog.records] + capsys.readouterr().err.splitlines()


def test_register_is_idempotent(fresh_plugin_state, caplog, capsys):
    caplog.set_level(logging.INFO, logger="vllm.vllm_specrl")
    plugin.register()
    first = plugin.state()
    plugin.register()
    assert plugin.state() == first
    assert first["status"] == "active" and first["role"] == "main"
    assert sum("plugin active" in m for m in _logged(caplog, capsys)) == 1


def test_unsupported_version_declines_with_one_warning(fresh_plugin_state, monkeypatch, caplog,
                                                       capsys):
    monkeypatch.setattr(vllm_versions, "vllm_version", lambda: "0.31.2")
    caplog.set_level(logging.INFO, logger="vllm.vllm_specrl")
    plugin.register()
    plugin.register()
    state = plugin.state()
    assert state["status"] == "declined" and "0.31.2" in state["reason"]
    warnings = [m for m in _logged(caplog, capsys) if "registers nothing" in m]
    assert len(warnings) == 1
    assert ">=0.32,<0.35" in warnings[0] and "0.31.2" in warnings[0]
    with pytest.raises(plugin.PluginDeclined, match="0.31.2"):   # a feature asked for there says why
        plugin.require_active()
