"""``FleetClient`` over two independent ``vllm serve`` replicas (tiny fixture): updates land on both or
on neither, a replica that fails to apply is quarantined (not left silently behind), and one online
trainer fed by both replicas' capture publishes its drafts to both.

Engines: three `vllm serve` replicas started side by side for the module and one trainer process:
the fleet and its quarantine need independent replicas.
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
from safetensors.torch import load_file

from conftest import WARM_DRAFT_VOCAB
from helpers import perturbed_checkpoint
from prompts import code_prompts
from vllm_specrl.faults import FAULTS_ENV
from vllm_specrl.proposer.checkpoint import init_draft
from vllm_specrl.launcher import VLLMServer, cpu_env, free_port, started
from vllm_specrl.sync.clients.fleet import FleetClient, FleetUpdateError

pytestmark = pytest.mark.server
KEY = "fleet-key"
FAILS_ON_A = 6  # replica A's loader fails part way through this policy version (a failpoint)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fleet")


@pytest.fixture(scope="module")
def capture_address():
    return f"tcp://127.0.0.1:{free_port()}"


KILLED_AT = 100  # replica C's engine is SIGKILLed part way through applying this policy version


@pytest.fixture(scope="module")
def servers(tiny_model, work, capture_address):
    """Replicas A and B serve the same policy and EAGLE-3 draft, both capturing to one trainer address;
    C (plain) is the one killed in the last test. All three start side by side."""
    init_draft(tiny_model, work / "draft", WARM_DRAFT_VOCAB, seed=5)
    spec = {"method": "eagle3", "model": str(work / "draft"), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}
    args = ["--dtype", "float32", "--max-model-len", "256", "--speculative-config", json.dumps(spec),
            "--additional-config", json.dumps({"specrl": {"capture": capture_address}})]
    env_a = dict(cpu_env(), **{FAULTS_ENV: f"apply:policy:{FAILS_ON_A}:5"})
    env_c = dict(cpu_env(), **{FAULTS_ENV: f"kill:policy:{KILLED_AT}:3"})
    with started(VLLMServer(tiny_model, args, api_key=KEY, env=env_a, log_path=work / "a.log"),
                 VLLMServer(tiny_model, args, api_key=KEY, log_path=work / "b.log"),
                 VLLMServer(tiny_model, ["--dtype", "float32", "--max-model-len", "256"], api_key=KEY, env=env_c,
                            log_path=work / "c.log")) as all_three:
        yield all_three


@pytest.fixture(scope="module")
def replicas(servers):
    return servers[:2]


@pytest.fixture(scope="module")
def fleet(replicas):
    return FleetClient([r.url for r in replicas], api_key=KEY)


@pytest.fixture(scope="module")
def weights(tiny_model, tmp_path_factory):
    new = perturbed_checkpoint(tiny_model, tmp_path_factory.mktemp("fleet_policy") / "v1", seed=2)
    return load_file(tiny_model / "model.safetensors"), load_file(new / "model.safetensors")


def texts(server) -> list[str]:
    r = requests.post(server.url + "/v1/completions", headers=server.headers, timeout=300, json={
        "model": server.model, "prompt": code_prompts(6), "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def policy_versions(fleet) -> list[int]:
    return [v["policy"] for v in fleet.versions().values()]


def test_an_update_reaches_every_replica(replicas, fleet, weights):
    original, new = weights
    a, b = replicas
    baseline = texts(a)
    assert texts(b) == baseline
    res = fleet.update_policy(new, version=1)
    assert sorted(res["committed"]) == sorted([a.url, b.url]) and not res["quarantined"]
    assert texts(a) == texts(b) != baseline
    fleet.update_policy(original, version=2)
    assert texts(a) == texts(b) == baseline and policy_versions(fleet) == [2, 2]


def test_a_refusal_on_one_replica_aborts_the_update_on_all(replicas, fleet, weights):
    original, new = weights
    a, b = replicas
    fleet.replicas[b.url].update_policy(original, version=5)  # B moved on alone (say, a manual fix)
    with pytest.raises(FleetUpdateError) as err:
        fleet.update_policy(new, version=3)
    assert list(err.value.replicas) == [b.url] and "above the current 5" in err.value.replicas[b.url]
    status_a = fleet.replicas[a.url].status()
    assert status_a["versions"]["policy"] == 2 and status_a["workers"][0]["sync"]["in_progress"] is None
    assert texts(a) == texts(b)  # A never applied v3's (different) weights


def test_a_replica_that_fails_to_apply_is_quarantined(replicas, fleet, weights):
    original, new = weights
    a, b = replicas
    res = fleet.update_policy(new, version=FAILS_ON_A)
    assert res["committed"] == [b.url] and list(res["quarantined"]) == [a.url]
    assert "failed while applying" in res["quarantined"][a.url]
    assert policy_versions(fleet) == [2, FAILS_ON_A]  # A restored its own last good weights
    res = fleet.update_policy(original, version=FAILS_ON_A + 1)
    assert res["committed"] == [b.url], "a quarantined replica gets no further updates"
    fleet.replicas[a.url].update_policy(original, version=FAILS_ON_A + 1)  # brought up to date by hand
    fleet.readmit(a.url)
    assert policy_versions(fleet) == [FAILS_ON_A + 1] * 2 and texts(a) == texts(b)
    res = fleet.update_policy(new, version=FAILS_ON_A + 2)
    assert sorted(res["committed"]) == sorted([a.url, b.url])


def test_fleet_rejects_an_empty_replica_list():
    with pytest.raises(ValueError):
        FleetClient([])


def test_one_trainer_learns_from_every_replica_and_publishes_to_all(replicas, fleet, work, tiny_model,
                                                                   capture_address):
    a, b = replicas
    log = work / "trainer.jsonl"
    out = open(work / "trainer.out", "w")  # noqa: SIM115 - kept open for the process
    trainer = subprocess.Popen(
        [sys.executable, "-m", "vllm_specrl.cli", "train-draft", "--capture", capture_address,
         "--engine", f"{a.url},{b.url}", "--api-key", KEY, "--draft", str(work / "draft"),
         "--target", str(tiny_model), "--publish-every", "2", "--checkpoint-every", "1000",
         "--batch-size", "4", "--idle-s", "0.5", "--log", str(log)],
        stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, TOKENIZERS_PARALLELISM="false",
                                                       OMP_NUM_THREADS="1"))
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert trainer.poll() is None, (work / "trainer.out").read_text()[-3000:]
            for server in (a, b):
                requests.post(server.url + "/v1/completions", headers=server.headers, timeout=300, json={
                    "model": server.model, "prompt": code_prompts(8), "max_tokens": 32, "temperature": 1.0,
                    "ignore_eos": True}).raise_for_status()
            drafts = [v.get("draft", 0) for v in fleet.versions().values()]
            if min(drafts) >= 1:
                break
        else:
            pytest.fail(f"no draft published to both replicas: {fleet.versions()}\n"
                        + (work / "trainer.out").read_text()[-3000:])
        # Read while the trainer runs: once it exits, the senders see it disconnected.
        statuses = [fleet.replicas[s.url].status() for s in (a, b)]
    finally:
        trainer.send_signal(signal.SIGINT)
        trainer.wait(60)
    # Both replicas streamed to the one trainer (their senders saw it connected), which reported its
    # ingestion to both with the publishes.
    why = (statuses, (work / "trainer.out").read_text()[-3000:])
    assert all(st["capture"]["frames_sent"] > 0 and st["capture"]["trainer_connected"] for st in statuses), why
    assert all(st["draft_trainer"] and st["draft_trainer"]["capture"]["ingested"] > 0 for st in statuses), why
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    published = [r["publish"] for r in records if r.get("publish") and "error" not in r["publish"]]
    assert published and sorted(published[-1]["committed"]) == sorted([a.url, b.url]), \
        (records[-3:], (work / "trainer.out").read_text()[-3000:])


def test_an_engine_killed_during_a_commit_is_quarantined_and_the_fleet_goes_on(servers, fleet, weights):
    """Replica C's engine process dies (SIGKILL, as an OOM kill would) after applying 3 tensors of an
    update: the update lands on the live replica, C is quarantined with the reason instead of hanging
    the fleet, the live replica serves requests throughout, and the next update goes on without C."""
    original, new = weights
    a, b, c = servers
    pair = FleetClient([b.url, c.url], api_key=KEY)
    with ThreadPoolExecutor(1) as pool:
        during = pool.submit(lambda: [texts(b) for _ in range(3)])
        res = pair.update_policy(original, version=KILLED_AT)
        served_during = during.result()
    assert res["committed"] == [b.url] and list(res["quarantined"]) == [c.url], res
    assert "engine core died" in res["quarantined"][c.url], res  # the 503, not a dropped connection
    assert len(served_during) == 3
    with pytest.raises(requests.RequestException):  # C's engine is gone: it serves nothing
        requests.post(c.url + "/v1/completions", headers=c.headers, timeout=60,
                      json={"model": c.model, "prompt": "x", "max_tokens": 2}).raise_for_status()
    fleet.replicas[a.url].update_policy(original, version=KILLED_AT)
    assert texts(a) == texts(b), "the live replica serves exactly the committed weights"
    res = pair.update_policy(new, version=KILLED_AT + 1)
    assert res["committed"] == [b.url] and not res["quarantined"]
    assert pair.versions()[b.url]["policy"] == KILLED_AT + 1
