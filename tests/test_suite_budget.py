"""The suite guards its own clock: a test module that starts an engine, a server or another
interpreter says why in its docstring (a paragraph starting ``Engines:``), so a new engine is a
decision a reviewer sees, and ``make test`` leaves out only what is marked ``slow``.
No engine starts here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# Calls that start an engine, a server or an interpreter (directly or through the suite's helpers).
STARTERS = re.compile(r"\b(run_python|run_function|in_engine_process|VLLMServer|sample_continuations|greedy_generate|"
                      r"record_drafts|run_rl_demo|EngineProcess|subprocess\.(run|Popen)|LLM)\(")


def engine_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if STARTERS.search(p.read_text()))


def test_the_scan_finds_the_engine_modules():
    names = {p.name for p in engine_modules()}
    assert {"test_lossless_sampling.py", "test_http.py", "test_weight_sync_server.py", "test_rl_demo.py"} <= names


@pytest.mark.parametrize("path", engine_modules(), ids=lambda p: str(p.relative_to(TESTS)))
def test_a_module_that_starts_engines_says_why(path: Path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    match = re.search(r"^Engines: (.+)", doc, re.M)
    assert match and len(match.group(1)) > 20, (
        f"{path.name} starts an engine, server or interpreter: its docstring needs a paragraph "
        "'Engines: <how many, and why they are not shared>'")


def test_the_slow_tier_is_named_in_pyproject_and_left_out_of_make_test():
    pyproject = (TESTS.parent / "pyproject.toml").read_text()
    assert re.search(r'^\s*"slow: ', pyproject, re.M)
    makefile = (TESTS.parent / "Makefile").read_text()
    test_recipe = re.search(r"^test: .*\n\t(.+)", makefile, re.M).group(1)
    assert '-m "not slow"' in test_recipe
    assert (TESTS.parent / ".ci" / "run").read_text().count("make test") >= 1
