"""The online loop end to end: vllm serve captures, `train-draft --capture` trains and publishes.

One server (tiny target, float32, a freshly initialised EAGLE-3 draft, capture
on via --additional-config) and one trainer process. RL-style traffic runs in
rounds; acceptance must rise as the draft learns, greedy outputs must stay
those of the start (lossless while draft weights change), and killing the
trainer must neither stall nor fail generation, and a restart resumes.

Engines: one `vllm serve` with capture plus a restart server, and trainer processes: the online loop
crosses processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import WARM_DRAFT_VOCAB
from prompts import code_prompts
from vllm_specrl.capture.sender import SEND_HWM, frames_settled
from vllm_specrl.proposer.checkpoint import init_draft
from vllm_specrl.launcher import VLLMServer, free_port, started

pytestmark = pytest.mark.server
ROUNDS = 10


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("online")
    draft = work / "draft"
    init_draft(tiny_model, draft, WARM_DRAFT_VOCAB, seed=5)
    capture = f"tcp://127.0.0.1:{free_port()}"
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}
    args = ["--dtype", "float32", "--max-model-len", "512", "--speculative-config", json.dumps(spec),
            "--worker-extension-cls", "vllm_specrl.sync.SpecRLWorkerExtension",
            "--additional-config", json.dumps({"specrl": {"capture": capture, "capture_topk": 64}})]
    # The restart test's first engine starts beside this one (side by side they take little more than one).
    restart_capture = f"tcp://127.0.0.1:{free_port()}"
    restart_args = ["--dtype", "float32", "--max-model-len", "512", "--speculative-config", json.dumps(spec),
                    "--additional-config", json.dumps({"specrl": {"capture": restart_capture}})]
    with started(VLLMServer(tiny_model, args, log_path=work / "serve.log"),
                 VLLMServer(tiny_model, restart_args, log_path=work / "serve_first.log")) as (srv, first):
        yield {"server": srv, "draft": draft, "capture": capture, "work": work, "target": tiny_model,
               "restart": {"first": first, "capture": restart_capture, "args": restart_args}}


def start_trainer(setup, tag: str, target=None) -> subprocess.Popen:
    out = open(setup["work"] / f"trainer_{tag}.out", "w")  # noqa: SIM115 - kept open for the process
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_specrl.cli", "train-draft", "--capture", setup["capture"],
         "--engine", setup["server"].url, "--draft", str(setup["draft"]),
         "--target", str(target or setup["target"]),
         "--publish-every", "4", "--checkpoint-every", "4", "--batch-size", "4", "--lr", "3e-3",
         "--idle-s", "0.5", "--log", str(setup["work"] / "online.jsonl")],
        stdout=out, stderr=subprocess.STDOUT,
        # One thread: vLLM's CPU worker binds core 0; the trainer gets the other.
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1"))


def status(srv) -> dict:
    return requests.get(srv.url + "/specrl/status", timeout=60).json()


def complete(srv, prompts, temperature: float, max_tokens: int = 48) -> list[str]:
    def one(p):
        r = requests.post(srv.url + "/v1/completions", timeout=300, json={
            "model": srv.model, "prompt": p, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, prompts))


def traffic_round(srv, prompts) -> dict:
    before = status(srv)["spec_decode"]
    complete(srv, prompts, 1.0)
    after = status(srv)
    drafts = after["spec_decode"]["num_drafts"] - before["num_drafts"]
    accepted = after["spec_decode"]["num_accepted_tokens"] - before["num_accepted_tokens"]
    return {"acceptance_length": 1 + accepted / max(drafts, 1), "draft_version": after["versions"]["draft"],
            "capture": after["capture"]}


def test_online_training_raises_acceptance_and_stays_lossless(setup):
    srv = setup["server"]
    greedy_prompts = code_prompts(12)
    baseline = complete(srv, greedy_prompts, 0.0, 24)
    pool = code_prompts(264)[200:]
    trainer = start_trainer(setup, "a")
    curve = []
    try:
        for r in range(ROUNDS):
            curve.append(traffic_round(srv, pool[(r * 16) % 48:(r * 16) % 48 + 16]))
            time.sleep(4.0)  # let the trainer take steps between rounds
            assert trainer.poll() is None, (setup["work"] / "trainer_a.out").read_text()[-3000:]
        assert complete(srv, greedy_prompts, 0.0, 24) == baseline  # lossless with a changed draft
    finally:
        trainer.send_signal(signal.SIGINT)
        trainer.wait(60)
    (setup["work"] / "curve.json").write_text(json.dumps(curve, indent=2))
    lengths = [c["acceptance_length"] for c in curve]
    assert curve[-1]["draft_version"] >= 2, curve
    assert sum(lengths[-3:]) / 3 > sum(lengths[:2]) / 2 + 0.1, lengths
    assert curve[-1]["capture"]["frames_sent"] > 0 and curve[-1]["capture"]["trainer_connected"]
    # The trainer's own account of every captured request reached the engine with its publishes (or,
    # where the publish gate kept the served draft, with a report alone), and equals what its log says
    # at the last of those.
    report = status(srv)["draft_trainer"]
    logged = [r for r in records(setup["work"] / "online.jsonl")
              if (r.get("publish") and "error" not in r["publish"]) or (r.get("gate") and not r["gate"]["publish"])]
    assert report["capture"] == logged[-1]["capture"] and report["capture"]["ingested"] > 0, (report, logged[-1])
    verdicts = [r["gate"] for r in records(setup["work"] / "online.jsonl") if r.get("gate")]
    assert report["publish_gate"]["better"] == sum(v["reason"] == "better" for v in verdicts) >= 2, verdicts
    text = requests.get(srv.url + "/metrics", timeout=30).text
    assert f'specrl_draft_trainer_requests{{outcome="ingested"}} {float(report["capture"]["ingested"])}' in text


def test_policy_update_needs_no_files_for_the_trainer(setup, tmp_path):
    """With capture_topk the soft targets travel in the frames: after a policy update the trainer
    keeps training on the new version's rollouts without reading the policy from disk (here the
    directory it was started from is gone)."""
    import shutil

    from vllm_specrl.sync.clients.engine_client import EngineClient

    srv = setup["server"]
    target_copy = tmp_path / "policy"
    shutil.copytree(setup["target"], target_copy)
    log = setup["work"] / "online.jsonl"
    trainer = start_trainer(setup, "nofiles", target=target_copy)
    try:
        wait_for(lambda: '"event": "started"' in (setup["work"] / "trainer_nofiles.out").read_text(), 180,
                 "trainer start")
        shutil.rmtree(target_copy)
        from safetensors.torch import load_file

        client = EngineClient(srv.url, progress=False)
        version = client.status()["versions"]["policy"] + 1
        weights = load_file(str(next(setup["target"].glob("*.safetensors"))))
        client.update_policy(weights.items(), version=version)
        pool = code_prompts(264)[200:216]

        def trained_on_new_version() -> bool:
            complete(srv, pool, 1.0)
            return any(r.get("policy_version") == version for r in records(log))

        wait_for(trained_on_new_version, 240, "training steps on the new policy version")
        assert trainer.poll() is None, (setup["work"] / "trainer_nofiles.out").read_text()[-3000:]
    finally:
        trainer.send_signal(signal.SIGINT)
        trainer.wait(60)


def test_dead_trainer_never_stalls_generation_and_restart_resumes(setup):
    srv = setup["server"]
    pool = code_prompts(264)[200:216]
    trainer = start_trainer(setup, "b")
    time.sleep(3.0)
    trainer.kill()
    trainer.wait(30)
    before = status(srv)["capture"]
    texts = complete(srv, pool, 1.0)  # no trainer: nothing may fail (or hang past the HTTP timeout)
    assert len(texts) == len(pool)
    after = status(srv)["capture"]
    delta = {k: after[k] - before[k] for k in ("frames_offered", "frames_sent", "frames_dropped_no_peer",
                                               "frames_dropped_peer_busy", "frames_dropped_queue_full", "queued")}
    # Every frame the tap offered is accounted for: handed to ZeroMQ, dropped (counted), or queued.
    assert delta["frames_offered"] > 2 * SEND_HWM, delta  # the premise: more than ZeroMQ can hold
    assert delta["frames_offered"] == frames_settled(delta) + delta["queued"], delta
    # With nobody reading, ZeroMQ absorbs at most its high-water marks; the rest were dropped.
    assert delta["frames_sent"] <= 2 * SEND_HWM + 8, delta
    restarted = start_trainer(setup, "c")
    try:
        time.sleep(8.0)
        complete(srv, pool, 1.0)
        time.sleep(3.0)
        out = (setup["work"] / "trainer_c.out").read_text()
        started = json.loads(next(ln for ln in out.splitlines() if '"event": "started"' in ln))
        assert started["resumed_from_step"], out[-2000:]
    finally:
        restarted.send_signal(signal.SIGINT)
        restarted.wait(60)


def test_trainer_survives_an_engine_restart(setup):
    """The engine goes away and comes back (same address): the trainer keeps running, its
    publishes fail while the engine is down (counted, not fatal), and it then publishes to
    the new engine, which serves the trained draft instead of the one on disk. The publish gate
    is off here (``--holdout-every 0``: a publish every 4 steps), so that what is tested does not
    hang on its verdicts: a held candidate makes no publish to fail, and a resting trainer none at
    all (its restore of a restarted engine's draft is tested in test_publish_gate.py)."""
    work = setup["work"]
    first, capture, args = (setup["restart"][k] for k in ("first", "capture", "args"))
    log = work / "restart.jsonl"
    out = open(work / "trainer_restart.out", "w")  # noqa: SIM115 - kept open for the process
    pool = code_prompts(264)[200:232]
    trainer = subprocess.Popen(
        [sys.executable, "-m", "vllm_specrl.cli", "train-draft", "--capture", capture, "--engine", first.url,
         "--draft", str(setup["draft"]), "--target", str(setup["target"]), "--checkpoint-dir",
         str(work / "restart-ckpt"), "--publish-every", "4", "--checkpoint-every", "1000", "--batch-size", "4",
         "--holdout-every", "0", "--idle-s", "0.5", "--log", str(log)],
        stdout=out, stderr=subprocess.STDOUT,
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1"))
    try:
        # The trainer must be listening and training before the engine goes away (on a loaded CI
        # machine it can take longer to start than the first traffic takes).
        wait_for(lambda: '"event": "started"' in (work / "trainer_restart.out").read_text(), 180, "trainer start")

        # The first engine gets a trained draft, so the second, serving the one on disk, has lost it.
        def traffic_then_published_first() -> bool:
            complete(first, pool[:8], 1.0)
            return status(first)["versions"]["draft"] >= 1

        wait_for(traffic_then_published_first, 180, "the trainer to publish to the first engine")
        first.stop()
        # It keeps training on its buffer; its publishes now fail (logged, not fatal).
        wait_for(lambda: any("error" in p for p in publishes(log)), 120, "a failed publish")
        assert trainer.poll() is None, (work / "trainer_restart.out").read_text()[-3000:]
        with VLLMServer(setup["target"], args, port=first.port, log_path=work / "serve_second.log") as second:
            # It starts from the draft on disk (version 0); any later version came from the trainer.
            def traffic_then_published() -> bool:
                complete(second, pool[:8], 1.0)
                return status(second)["versions"]["draft"] >= 1

            wait_for(traffic_then_published, 120, "the trainer to publish to the new engine")
            assert trainer.poll() is None
    finally:
        first.stop()
        trainer.send_signal(signal.SIGINT)
        trainer.wait(60)
    assert any("error" in p for p in publishes(log)), "no publish failed while the engine was down"


def records(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


def steps_logged(log) -> int:
    return len(records(log))


def publishes(log) -> list[dict]:
    return [r["publish"] for r in records(log) if r.get("publish")]


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if condition():
            return
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
