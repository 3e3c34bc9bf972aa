"""``vllm-specrl selftest`` as a user runs it: it passes on this CPU with the tiny fixture, and fails,
naming the check, when a lossy setting is switched on: vLLM's own samplers
(``VLLM_SPECRL_FAST_SAMPLING=0``) with vLLM CPU's expand-kernel fault left in place
(``VLLM_SPECRL_CPU_EXPAND_FIX=0``) make speculative sampling at T = 1 lossy (min p = 0 here).

Engines: two selftest commands, each a fresh interpreter that starts its engines in processes of their
own (plain, EAGLE-3, history; then plain and EAGLE-3): the command is what is tested, so it runs as a
user runs it rather than from the suite's zygote."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ALL_CHECKS = {"EAGLE-3 greedy = plain", "EAGLE-3 T=1 distribution = plain", "policy update applied",
              "policy update refused when malformed", "draft update applied", "draft update refused when malformed",
              "capture delivers rows", "status and patches", "history greedy = plain",
              "history T=1 distribution = plain"}


# Fewer samples than the command's default: the lossy setting below is still rejected far beyond the selftest's
# alpha at this count, and a lossless engine's p-values do not depend on it; engine start-ups are most of the rest.
SAMPLES = 1000


def _selftest(tiny_model, out, *args, env=None):
    proc = subprocess.run([sys.executable, "-m", "vllm_specrl.cli", "selftest", "--model", str(tiny_model),
                           "--json", str(out), "--samples", str(SAMPLES), *args], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=1800)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_selftest_passes_on_this_cpu(tiny_model, tmp_path):
    proc, report = _selftest(tiny_model, tmp_path / "selftest.json")
    assert report is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == ALL_CHECKS and report["samples"] == SAMPLES
    assert report["passed"] and proc.returncode == 0, proc.stdout
    assert "selftest: 10 passed, 0 failed" in proc.stdout


def test_selftest_fails_when_a_lossy_setting_is_on(tiny_model, tmp_path):
    proc, report = _selftest(tiny_model, tmp_path / "selftest.json", "--only", "eagle3",
                             env={"VLLM_SPECRL_FAST_SAMPLING": "0", "VLLM_SPECRL_CPU_EXPAND_FIX": "0"})
    assert report is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["name"]: c for c in report["checks"]}
    assert proc.returncode == 1 and not report["passed"]
    assert checks["EAGLE-3 greedy = plain"]["passed"]  # greedy never meets the fault
    assert not checks["EAGLE-3 T=1 distribution = plain"]["passed"], checks
    assert "FAIL" in proc.stdout
