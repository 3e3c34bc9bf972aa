"""``vllm-specrl selftest`` as a user runs it: with a lossy setting switched on it runs every check, fails
exactly the two T = 1 checks and names them; with the product's settings it passes on this CPU (the
sleep/wake check SKIPPED: no sleep mode here); a planted lossy logprob path fails the logprob checks.
The lossy setting: vLLM's own samplers (``VLLM_SPECRL_FAST_SAMPLING=0``) with vLLM CPU's expand-kernel
fault left in place (``VLLM_SPECRL_CPU_EXPAND_FIX=0``) make speculative sampling at T = 1 lossy
(min p = 0 for EAGLE-3, ~1e-64 for the history proposer here).

``make test`` runs the lossy one: it goes through every check's code (engines, updates, capture, status)
and shows the T = 1 checks can fail. That they pass with the fixes in is what
``tests/test_lossless_sampling.py`` tests for the same proposers in ``make test``; the command's own
passing run is the slower tier's.

Engines: one selftest command per test, each a fresh interpreter that starts its engines in processes of
their own (plain, EAGLE-3, history): the command is what is tested, so it runs as a user runs it rather
than from the suite's zygote."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ALL_CHECKS = {"EAGLE-3 greedy = plain", "EAGLE-3 T=1 distribution = plain", "policy update applied",
              "policy update refused when malformed", "draft update applied", "draft update refused when malformed",
              "capture delivers rows", "status and patches", "history greedy = plain",
              "history T=1 distribution = plain", "EAGLE-3 logprobs = plain", "history logprobs = plain",
              "drafter survives sleep/wake"}


# Fewer samples than the command's default: the lossy setting below is still rejected far beyond the selftest's
# alpha at this count, and a lossless engine's p-values do not depend on it; engine start-ups are most of the rest.
SAMPLES = 1000


def _selftest(tiny_model, out, env=None):
    proc = subprocess.run([sys.executable, "-m", "vllm_specrl.cli", "selftest", "--model", str(tiny_model),
                           "--json", str(out), "--samples", str(SAMPLES)], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=1800)
    return proc, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.slow
def test_selftest_passes_on_this_cpu(tiny_model, tmp_path):
    proc, report = _selftest(tiny_model, tmp_path / "selftest.json")
    assert report is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == ALL_CHECKS and report["samples"] == SAMPLES
    assert report["passed"] and proc.returncode == 0, proc.stdout
    assert "selftest: 12 passed, 0 failed, 1 skipped" in proc.stdout  # no sleep mode on the CPU
    assert checks["drafter survives sleep/wake"]["skipped"]


def test_selftest_runs_every_check_and_fails_the_lossy_ones(tiny_model, tmp_path):
    proc, report = _selftest(tiny_model, tmp_path / "selftest.json",
                             env={"VLLM_SPECRL_FAST_SAMPLING": "0", "VLLM_SPECRL_CPU_EXPAND_FIX": "0"})
    assert report is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == ALL_CHECKS and report["samples"] == SAMPLES
    assert proc.returncode == 1 and not report["passed"]
    lossy = {"EAGLE-3 T=1 distribution = plain", "history T=1 distribution = plain"}
    failed = {name for name, check in checks.items() if not check["passed"]}
    assert failed == lossy, checks  # greedy, updates, capture, status and logprobs never meet the fault
    assert "selftest: 10 passed, 2 failed, 1 skipped" in proc.stdout and proc.stdout.count("FAIL") >= 2


@pytest.mark.slow
def test_a_lossy_logprob_path_fails_the_logprob_checks(tiny_model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vllm_specrl.cli", "selftest", "--model", str(tiny_model),
                           "--json", str(tmp_path / "s.json"), "--only", "logprobs"],
                          env={**os.environ, "VLLM_SPECRL_FAULTS": "logprobs:0.05"}, capture_output=True, text=True,
                          timeout=1800)
    report = json.loads((tmp_path / "s.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"EAGLE-3 logprobs = plain", "history logprobs = plain"}, proc.stdout[-3000:]
    assert not any(c["passed"] for c in checks.values()) and proc.returncode == 1


def test_an_unknown_check_group_is_named_before_any_engine_starts(tiny_model, capsys):
    from vllm_specrl import cli

    assert cli.main(["selftest", "--model", str(tiny_model), "--only", "eagle3,updatez"]) == 2
    err = capsys.readouterr().err
    assert "unknown check groups ['updatez']" in err and "eagle3, history, updates, capture, status" in err
