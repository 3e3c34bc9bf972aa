"""``examples/ray_fleet.py``: a trainer and two speculative engine replicas as Ray actors (each replica a
whole engine with the plugin, as vLLM's CPU build cannot run its own Ray executor:
``scripts/repro/repro_cpu_ray_executor.py``), the policy broadcast once per step to both over
``specrl_gloo``, then a draft.

What would fail: a replica left behind by the broadcast (its version, or its greedy tokens against a
fresh plain engine on the trainer's weights), a speculative replica whose greedy tokens differ from
plain (not lossless), no drafts served, capture frames not stamped with the new versions, a draft
round not counted, a drafter reported changed behind the plugin's back.

Engines: two replicas and one fresh plain engine, each in a Ray actor on a local Ray (slow tier).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytestmark = [pytest.mark.server, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
STEPS = 2


def test_ray_fleet_example(tiny_model, tmp_path):
    from vllm_specrl.proposer.checkpoint import init_draft

    init_draft(tiny_model, tmp_path / "draft", 1024, seed=0)
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "ray_fleet.py"), "--policy", str(tiny_model),
                           "--draft", str(tmp_path / "draft"), "--steps", str(STEPS)],
                          capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("REPORT "))[7:])
    for rec in report["steps"]:
        assert rec["versions"] == [{"policy": rec["step"], "draft": 0}] * 2, rec
    assert report["versions_after_draft"] == [{"policy": STEPS, "draft": STEPS}] * 2
    assert report["replica_greedy"] == [report["fresh_plain_greedy"]] * 2
    assert all(sd["num_drafts"] > 0 for sd in report["spec_decode"]), report["spec_decode"]
    assert report["draft_mismatch"] == [None, None]
    frames = report["captured_frames_by_policy_version"]
    assert all(frames.get(str(v), 0) > 0 for v in range(STEPS)), frames
