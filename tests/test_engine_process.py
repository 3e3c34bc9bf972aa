"""``in_engine_process`` / ``run_function``: a test's own function runs in a child interpreter of the suite's
zygote, its arguments and value cross by pickle, and its failure fails the caller with the child's traceback.

Engines: none; three child interpreters (forked from the session's zygote), no model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import in_engine_process, run_function


@in_engine_process(env={"SPECRL_TEST_MARK": "child"})
def where_am_i(path: Path, scale: float = 1.0) -> dict:
    return {"pid": os.getpid(), "mark": os.environ.get("SPECRL_TEST_MARK"), "path": path, "scaled": 2 * scale}


@in_engine_process()
def fails() -> None:
    raise ValueError("planted in the child")


def plain(x: int) -> int:
    return x + 1


def test_the_function_runs_elsewhere_and_its_value_comes_back(tmp_path):
    got = where_am_i(tmp_path, scale=1.5)
    assert got["pid"] != os.getpid() and got["mark"] == "child"
    assert got["path"] == tmp_path and got["scaled"] == 3.0


def test_a_failure_in_the_child_fails_the_test_with_its_traceback():
    with pytest.raises(AssertionError, match="ValueError: planted in the child"):
        fails()


def test_an_undecorated_function_runs_through_run_function():
    assert run_function(plain, 41) == 42
