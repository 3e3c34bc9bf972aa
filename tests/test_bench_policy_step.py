"""``scripts/bench/bench_policy_step.py`` end to end on the tiny fixture: every mode runs in its own
process with the allocator it names, and the summary is the mean of the steps it recorded.

Engines: the benchmark script end to end, one process per allocator mode (slow tier).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_each_mode_runs_with_its_allocator_and_the_summary_follows_from_the_steps(tiny_model, tmp_path):
    out = tmp_path / "policy_step.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "bench_policy_step.py"), "--target",
                    str(tiny_model),
                    "--modes", "default,heap", "--rounds", "1", "--steps", "3", "--skip", "1", "--samples", "4",
                    "--max-tokens", "24", "--out", str(out)], check=True, cwd=REPO, timeout=300)
    report = json.loads(out.read_text())
    allocators = {r["mode"]: r["allocator"] for r in report["runs"]}
    assert allocators == {"default": "untouched", "heap": "installed, every block on the heap"}, allocators
    for run in report["runs"]:
        assert len(run["steps"]) == 3 and all(s["tokens"] >= 4 * 16 for s in run["steps"]), run
        kept = run["steps"][1:]
        summary = report["summary"][run["mode"]]
        for key in ("logprob_ms_per_token", "update_ms_per_token", "logprob_faults"):
            assert abs(summary[key] - sum(s[key] for s in kept) / len(kept)) < 1e-9, (key, summary, kept)
