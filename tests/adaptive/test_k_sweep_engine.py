"""``vllm-specrl calibrate`` against a served engine (tiny fixture, EAGLE-3, adaptive k, in-process):
the sweep's requests reach the engine core's scheduler under ids it recognises, every k is
measured in each batch bucket up to ``max_batch``, and the acceptance estimate stays the workload's.

Engines: one `vllm serve` for the module (the calibrate CLI talks to a served engine over HTTP).
"""

from __future__ import annotations

import json

import pytest
import requests

from vllm_specrl.adaptive import SCHEDULER_CLS
from vllm_specrl.adaptive.k_sweep import calibrate
from vllm_specrl.adaptive.controller import AdaptiveKConfig
from vllm_specrl.proposer.checkpoint import init_draft
from vllm_specrl.launcher import VLLMServer, cpu_env

pytestmark = pytest.mark.server
PROMPT = "def fibonacci(n):\n    "


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("calibrate")
    init_draft(tiny_model, work / "draft", seed=0)
    spec = {"method": "eagle3", "model": str(work / "draft"), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}
    args = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8",
            "--speculative-config", json.dumps(spec),
            "--scheduler-cls", SCHEDULER_CLS]
    env = dict(cpu_env(), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with VLLMServer(tiny_model, args, log_path=work / "serve.log", env=env) as srv:
        yield srv


def complete(server, max_tokens: int = 32) -> None:
    r = requests.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "seed": 1,
        "ignore_eos": True})
    r.raise_for_status()


def test_a_sweep_measures_every_k_and_leaves_acceptance_to_the_workload(server):
    complete(server)
    before = server.status()["adaptive_k"]
    report = calibrate(server.url, max_batch=4)
    after = server.status()["adaptive_k"]
    assert report["adaptive_k"] and [b["batch"] for b in report["batches"]] == [4, 3, 2, 1], report
    assert all(b["swept"] for b in report["batches"]), report
    for label in ("4-5", "3-3", "2-2", "1-1"):
        bucket = after["buckets"][label]
        assert bucket["swept"] and bucket["calibrated"] and not bucket["from_neighbour"], (label, bucket)
    assert not after["buckets"]["8-8"]["swept"]
    assert after["calibration_steps"] > before["calibration_steps"] == 0
    assert after["explored_steps"] == before["explored_steps"], (before, after)
    # The sweep's drafts never reach the acceptance estimate; a real request's do. With a random
    # draft the bucket may serve k = 0 after the sweep (where drafting cannot pay on the machine at
    # hand), so the request runs long enough for a burst at k = 1 (after explore_first steps).
    assert after["acceptance_drafts"] == before["acceptance_drafts"], (before, after)
    complete(server, max_tokens=3 * AdaptiveKConfig().explore_first)
    assert server.status()["adaptive_k"]["acceptance_drafts"] != after["acceptance_drafts"]


def test_a_second_sweep_finds_every_bucket_done(server):
    report = calibrate(server.url, max_batch=4)
    assert [b["rounds"] for b in report["batches"]] == [1, 1, 1, 1], report
