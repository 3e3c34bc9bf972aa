"""Modules of an earlier layout stay importable by their old names: the same module object (patching either
patches both), its own spec kept, a DeprecationWarning naming the new place; and no old file lingers."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest

from vllm_specrl import _moved

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_name_gives_the_module_at_its_new_place(old):
    new = importlib.import_module(_moved.MOVED[old])
    spec = new.__spec__
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is new
    assert module.__spec__ is spec and module.__spec__.name == _moved.MOVED[old]
    assert [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)] == [
        f"{old} moved to {_moved.MOVED[old]}; the old name will be removed"]


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_no_file_is_left_at_an_old_place(old):
    place = ROOT / old.replace(".", "/")
    assert not place.with_suffix(".py").exists() and not place.is_dir()


def test_the_paths_users_write_in_vllm_flags_still_resolve():
    from vllm_specrl.adaptive.scheduler import AdaptiveKScheduler  # --scheduler-cls
    from vllm_specrl.proposer.history import HistoryProposer  # "custom_class" speculative model
    from vllm_specrl.sync import SpecRLWorkerExtension  # --worker-extension-cls

    assert AdaptiveKScheduler and HistoryProposer and SpecRLWorkerExtension
