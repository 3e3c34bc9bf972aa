"""The in-process rollout worker example (``examples/inprocess_rollout.py``) on the tiny target with an
EAGLE-3 draft: a real ``AsyncLLM`` with a framework's worker extension combined with the package's, capture
started from the engine's configuration, an async policy commit with a rollout in flight, a malformed
update refused, and the online draft trainer in a thread publishing into the engine without HTTP.

References: the served parameters read back through the framework's own RPC against the pushed tensors;
greedy text before and after a refused update (the old weights keep serving); the workers' versions.

Engines: one example run in its own interpreter (an AsyncLLM with its engine core and an online trainer
thread), shared by every test here: the example is what a framework user runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inprocess_rollout.py"


@pytest.fixture(scope="module")
def report(tiny_model, warm_draft, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("inprocess")
    out = work / "report.json"
    # A user's start method (spawn): the suite's fork shortcut hung an AsyncLLM's worker at start-up.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SPECRL_CPU_START_METHOD"}
    env.update(VLLM_PLUGINS="specrl", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--policy", str(tiny_model), "--draft", str(warm_draft),
                           "--work", str(work), "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


def test_outputs_carry_the_policy_version_they_were_sampled_under(report):
    assert {(o["policy_version_start"], o["policy_version"]) for o in report["before"]} == {(0, 0)}
    assert {(o["policy_version_start"], o["policy_version"]) for o in report["after_commit"]} == {(1, 1)}
    # in flight across the commit: started on version 0, answered under version 1
    assert [(o["policy_version_start"], o["policy_version"]) for o in report["in_flight"]] == [(0, 1)]


def test_a_malformed_update_is_refused_and_the_old_weights_keep_serving(report):
    assert report["refused"]["ok"] is False and "model.norm.weight" in json.dumps(report["refused"])
    assert [o["tokens"] for o in report["after_refusal"]] == [o["tokens"] for o in report["before"]]


def test_the_async_commit_applied_the_pushed_weights_on_the_served_model(report):
    assert report["committed"]["ok"] is True and report["committed"]["version"] == 1
    assert report["committed"]["prefix_cache_reset"] is True
    served, pushed = report["served_sums"], report["pushed_sums"]   # the framework's own RPC reads them
    assert served.keys() == pushed.keys() and all(abs(served[k] - pushed[k]) < 1e-6 * max(1, abs(pushed[k]))
                                                  for k in pushed)
    assert [o["tokens"] for o in report["after_commit"]] != [o["tokens"] for o in report["before"]]


def test_capture_started_from_the_configuration_and_the_trainer_published_in_process(report):
    capture = report["status"]["capture"]
    assert capture is not None and capture["frames_sent"] > 0   # no capture RPC was ever called
    trainer = report["trainer"]
    assert trainer["steps"] > 0
    assert report["status"]["versions"]["draft"] >= 1   # a draft committed through SpecRLEngine
    assert report["status"]["draft_trainer"] is not None
