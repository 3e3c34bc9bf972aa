"""``--additional-config '{"specrl": {"drafter": ...}}'`` is read strictly: a typo or an unknown mode is
an error at start-up, not a default silently served."""

from __future__ import annotations

import pytest

from vllm_specrl.lifecycle.config import DrafterConfig


def test_defaults_and_values():
    assert DrafterConfig.from_dict(None) == DrafterConfig()
    config = DrafterConfig.from_dict({"on_damage": "refuse", "check_every_s": 0, "collapse_window": "32"})
    assert (config.on_damage, config.check_every_s, config.collapse_window) == ("refuse", 0.0, 32)


@pytest.mark.parametrize("raw, words", [({"on_damage": "fix"}, "on_damage"), ({"check_every": 1}, "unknown keys"),
                                        ({"collapse_window": 0}, "collapse_window"), ("repair", "object")])
def test_bad_settings_are_refused_with_the_reason(raw, words):
    with pytest.raises(ValueError, match=words):
        DrafterConfig.from_dict(raw)
