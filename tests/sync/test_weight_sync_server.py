"""In-place policy and draft updates through ``vllm serve`` + ``EngineClient``.

One real server (3 processes, float32, an EAGLE-3 draft with a random head)
shared by the module; tests run in file order and each leaves the server
serving a known version. Exactness is checked against fresh engines started
from checkpoints of the same weights.

Engines: one `vllm serve` shared by the module in file order, fresh in-process engines for the
reference outputs of each update, a publisher process killed mid-update, and two online draft trainers
(one without the server's key, one with it).
"""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from safetensors.torch import load_file, save

from conftest import WARM_DRAFT_VOCAB
from helpers import perturbed_checkpoint
from prompts import code_prompts
from sampling import greedy_generate
from vllm_specrl.proposer.checkpoint import init_draft
from vllm_specrl.faults import FAULTS_ENV
from vllm_specrl.launcher import VLLMServer, cpu_env
from vllm_specrl.sync.clients.engine_client import EngineClient, WeightSyncError

pytestmark = pytest.mark.server
KEY = "sync-key"
MAX_TOKENS = 16
FAILING_POLICY_VERSION = 99  # the server's loader fails part way through this update (a failpoint)
FAULTS = f"apply:policy:{FAILING_POLICY_VERSION}:7"
IDLE_TIMEOUT_S = 8.0  # an update silent this long was abandoned (the default is 300 s)


@pytest.fixture(scope="module")
def prompts():
    return code_prompts(24)


@pytest.fixture(scope="module")
def original(tiny_model):
    return load_file(tiny_model / "model.safetensors")


@pytest.fixture(scope="module")
def new_policy(tiny_model, tmp_path_factory):
    """A checkpoint of perturbed tiny weights (what an RL step would produce, exaggerated)."""
    return perturbed_checkpoint(tiny_model, tmp_path_factory.mktemp("policy") / "v1", seed=0)


@pytest.fixture(scope="module")
def random_draft(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft") / "random"
    init_draft(tiny_model, out, WARM_DRAFT_VOCAB, seed=3)
    return out


@pytest.fixture(scope="module")
def server(tiny_model, random_draft, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "vllm_serve.log"
    spec = {"method": "eagle3", "model": str(random_draft), "num_speculative_tokens": 3}
    args = ["--dtype", "float32", "--max-model-len", "512", "--speculative-config", json.dumps(spec),
            "--additional-config", json.dumps({"specrl": {"update_idle_timeout_s": IDLE_TIMEOUT_S}})]
    with VLLMServer(tiny_model, args, api_key=KEY, log_path=log, env={**cpu_env(), FAULTS_ENV: FAULTS}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return EngineClient(server.url, api_key=KEY, progress=False)


def served_texts(server, prompts) -> list[str]:
    r = requests.post(server.url + "/v1/completions", headers=server.headers, timeout=300, json={
        "model": server.model, "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def fresh_texts(model, prompts) -> list[str]:
    return greedy_generate(model, prompts, MAX_TOKENS, with_text=True)["texts"]


@pytest.fixture(scope="module")
def baseline(server, prompts):
    return served_texts(server, prompts)


def versions(client) -> dict:
    return client.status()["versions"]


def test_update_routes_refuse_without_the_api_key(server):
    r = requests.post(server.url + "/specrl/update/begin", json={"target": "policy", "version": 1})
    assert r.status_code == 401
    assert requests.post(server.url + "/specrl/pause", json={}).status_code == 401


def bad_updates(original, draft):
    name = "model.layers.0.self_attn.q_proj.weight"
    # a policy update aimed at every model (miles #1926): the draft's own tensors in it are refused, named
    yield "the draft's tensors", {**original, "d2t": draft["d2t"]}, "d2t: unknown parameter name (the draft's tensor"
    yield "wrong shape", {**original, name: original[name][:-1]}, f"{name}: shape"
    yield "wrong dtype", {**original, name: original[name].to(torch.int32)}, f"{name}: dtype torch.int32"
    yield "unknown name", {**original, "model.layers.9.extra.weight": torch.zeros(3)}, \
        "model.layers.9.extra.weight: unknown parameter name"
    nan = original[name].clone()
    nan[0, 0] = float("nan")
    yield "NaN", {**original, name: nan}, f"{name}: 1 non-finite values"
    yield "truncated", dict(list(original.items())[: len(original) // 2]), "incomplete"


def test_the_drafters_lifecycle_and_the_logprob_report_reach_status_and_metrics(server, client, baseline):
    status = client.status()  # after the baseline's steps: the engine core's lifecycle is published
    drafter = status["drafter"]
    assert drafter["on_damage"] == "repair" and not drafter["draft_collapsed"] and not drafter["refusing"], drafter
    worker = status["workers"][0]
    assert worker["weight_watch"]["load_checks"]["errors"] == []
    assert worker["sync"]["host_bytes"]["last_good"]["draft"] > 0  # the host copy, from the first load
    client.report_logprobs({"max": 0.02, "mean": 0.004, "tokens": 100, "step": 3})
    assert client.status()["logprob_conformance"]["max"] == 0.02
    text = requests.get(server.url + "/metrics", timeout=30).text
    assert 'specrl_draft_collapsed{engine="0"} 0.0' in text and 'specrl_draft_refused{engine="0"} 0.0' in text
    assert 'specrl_logprob_abs_diff{stat="max"} 0.02' in text
    bad = requests.post(server.url + "/specrl/logprobs", headers=server.headers, json={"mean": 1}, timeout=30)
    assert bad.status_code == 400 and "'max'" in bad.json()["error"]


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_bad_updates_are_refused_and_change_nothing(server, original, random_draft, prompts, baseline, transport):
    client = EngineClient(server.url, api_key=KEY, transport=transport, progress=False,
                          chunk_bytes=1 << 20)
    for label, tensors, needle in bad_updates(original, load_file(random_draft / "model.safetensors")):
        with pytest.raises(WeightSyncError) as err:
            client.update_policy(tensors, version=1)
        assert needle in str(err.value) + " ".join(err.value.problems), (label, str(err.value))
        assert "nothing applied" in str(err.value), label
    assert versions(client) == {"policy": 0, "draft": 0}
    assert served_texts(server, prompts) == baseline


def test_protocol_misuse_is_refused(server, client, original):
    post = lambda path, **kw: requests.post(server.url + path, headers=server.headers, timeout=60, **kw)  # noqa: E731
    r = post("/specrl/update/nope/commit", json={})
    assert r.status_code == 400 and "no update in progress" in r.json()["error"]
    uid = post("/specrl/update/begin", json={"target": "policy", "version": 1}).json()["update_id"]
    second = post("/specrl/update/begin", json={"target": "draft", "version": 1})
    assert second.status_code == 409 and f"update {uid}" in second.json()["error"]  # busy (no wait_s)
    body = save(dict(list(original.items())[:3]))
    r = post(f"/specrl/update/{uid}/tensors", data=body[: len(body) // 2])
    assert r.status_code == 400 and "not a complete safetensors chunk" in r.json()["error"]
    r = post(f"/specrl/update/{uid}/commit", json={})
    assert r.status_code == 400 and "no update in progress" in r.json()["error"]  # aborted
    assert versions(client) == {"policy": 0, "draft": 0}


FUZZED_BODIES = 200


def fuzzed_chunks(valid: bytes, n: int, seed: int):
    """Mutations of one valid safetensors chunk: truncated, header bytes flipped, header length
    forged, body bytes flipped, garbage."""
    rng = random.Random(seed)
    header_end = 8 + int.from_bytes(valid[:8], "little")
    for i in range(n):
        body = bytearray(valid)
        kind = ("truncated", "header flip", "header length", "body flip", "garbage")[i % 5]
        if kind == "truncated":
            body = body[: rng.randrange(len(body))]
        elif kind == "header flip":
            for _ in range(rng.randint(1, 8)):
                body[rng.randrange(8, header_end)] = rng.randrange(256)
        elif kind == "header length":
            body[:8] = rng.choice([0, 1, header_end, len(body) * 4, 2**63 - 1]).to_bytes(8, "little")
        elif kind == "body flip":
            for _ in range(rng.randint(1, 8)):
                body[rng.randrange(header_end, len(body))] = rng.randrange(256)
        else:
            body = bytearray(rng.randbytes(rng.randrange(1, 4096)))
        yield kind, bytes(body)


def test_fuzzed_update_chunks_are_refused_and_change_nothing(server, client, original, prompts, baseline):
    """Every mangled chunk gets a 4xx answer naming the problem (never a 5xx, never a hang), the
    update it was part of applies nothing, and serving is unchanged; a body flip that still parses
    to finite values of the right shape is a valid chunk and may be staged, but its update, left
    incomplete, is refused at commit."""
    post = lambda path, **kw: requests.post(server.url + path, headers=server.headers, timeout=60, **kw)  # noqa: E731
    name = "model.norm.weight"
    outcomes: dict[str, int] = {}
    for kind, body in fuzzed_chunks(save({name: original[name]}), FUZZED_BODIES, seed=11):
        uid = post("/specrl/update/begin", json={"target": "policy", "version": 1}).json()["update_id"]
        r = post(f"/specrl/update/{uid}/tensors", data=body)
        assert r.status_code in (200, 400), (kind, r.status_code, r.text[:300])
        if r.status_code == 400:
            assert r.json()["error"], kind
        commit = post(f"/specrl/update/{uid}/commit", json={})
        assert commit.status_code == 400, (kind, commit.text[:300])  # never a whole update
        post(f"/specrl/update/{uid}/abort")
        outcomes[f"{kind}:{r.status_code}"] = outcomes.get(f"{kind}:{r.status_code}", 0) + 1
    assert sum(n for k, n in outcomes.items() if k.endswith(":400")) > FUZZED_BODIES // 2, outcomes
    assert versions(client) == {"policy": 0, "draft": 0}
    assert served_texts(server, prompts) == baseline


def test_update_policy_equals_a_fresh_engine_on_the_new_weights(server, client, new_policy, original,
                                                                prompts, baseline):
    expected = fresh_texts(new_policy, prompts)
    assert expected != baseline, "the perturbation must change greedy outputs"
    res = client.update_policy(load_file(new_policy / "model.safetensors"), version=1)
    assert res["transport"] == "shm" and res["version"] == 1
    assert served_texts(server, prompts) == expected
    r = requests.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                      json={"model": server.model, "prompt": "x", "max_tokens": 2})
    assert r.headers["x-specrl-policy-version"] == "1"
    # And back, over HTTP this time: the original outputs return exactly.
    http = EngineClient(server.url, api_key=KEY, transport="http", progress=False)
    assert http.update_policy(original, version=2)["transport"] == "http"
    assert served_texts(server, prompts) == baseline
    assert versions(client) == {"policy": 2, "draft": 0}


def test_a_commit_that_fails_while_applying_restores_the_last_good_weights(server, client, new_policy,
                                                                            prompts, baseline):
    """The loader raises after 7 of the update's tensors (layers half new): the worker re-applies
    the last committed update (v2, the original weights), the version stays, the update is closed."""
    with pytest.raises(WeightSyncError) as err:
        client.update_policy(load_file(new_policy / "model.safetensors"), version=FAILING_POLICY_VERSION)
    message = str(err.value)
    assert "failed while applying" in message and "injected fault" in message, message
    assert "restored policy v2" in message and "version stays 2" in message, message
    assert served_texts(server, prompts) == baseline  # exactly the old weights, not a mix
    status = client.status()
    assert status["versions"]["policy"] == 2
    assert status["last_commit_failure"]["rolled_back"] is True
    failure = status["workers"][0]["sync"]["last_failure"]
    assert failure["version"] == FAILING_POLICY_VERSION and failure["restored"] and failure["serving_version"] == 2
    assert status["workers"][0]["sync"]["in_progress"] is None  # closed: the next update may begin


def test_stale_draft_guard_reports_version_lag(server, client, original):
    client.update_policy(original, version=3)  # draft now 3 versions behind
    status = client.status()
    assert status["stale_draft"]["stale"], status["stale_draft"]
    assert "lags policy version 3 by 3" in status["stale_draft"]["reasons"][0]
    text = requests.get(server.url + "/metrics", timeout=30).text
    assert "specrl_draft_stale 1.0" in text and "specrl_policy_version 3.0" in text


def test_update_draft_raises_acceptance_and_stays_lossless(server, client, warm_draft, prompts, baseline):
    def acceptance() -> float:
        before = client.status()["spec_decode"]
        assert served_texts(server, prompts) == baseline  # lossless with either draft
        after = client.status()["spec_decode"]
        return (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / (
            after["num_drafts"] - before["num_drafts"])

    random_accept = acceptance()
    res = client.update_draft(load_file(warm_draft / "model.safetensors"), version=3)
    assert res["target"] == "draft" and res["version"] == 3
    warm_accept = acceptance()
    assert warm_accept > random_accept + 0.3, (random_accept, warm_accept)
    status = client.status()
    assert status["versions"] == {"policy": 3, "draft": 3} and not status["stale_draft"]["stale"]


KILLED_PUBLISHER = """
import sys, time
from safetensors.torch import load_file
from vllm_specrl.sync.clients.engine_client import EngineClient

url, key, draft, version = sys.argv[1:5]
client = EngineClient(url, api_key=key, transport="http", chunk_bytes=1 << 16, progress=False)
upload = client._upload

def first_chunk_then_hang(uid, chunk, transport):
    upload(uid, chunk, transport)
    print("UPLOADED", uid, flush=True)
    time.sleep(3600)  # killed here, half-way through its publish

client._upload = first_chunk_then_hang
client.update_draft(load_file(draft + "/model.safetensors"), version=int(version))
"""


def test_a_publisher_killed_mid_update_blocks_nothing(server, client, warm_draft, prompts):
    """A trainer SIGKILLed after its first chunk leaves an open update (no abort ever comes): the
    engine keeps serving the old draft, a begin that will not wait is refused (409) naming it, and
    a begin that waits gets through once the dead update has been idle for the timeout (the
    waiting begin aborts it)."""
    import subprocess
    import sys
    import time

    before = versions(client)
    texts = served_texts(server, prompts)
    # The server's idle clock starts at the publisher's last call, before the kill: the lower bound
    # on when the dead update may be abandoned is measured from before the publisher started.
    spawned_at = time.time()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PUBLISHER, server.url, KEY, str(warm_draft),
                             str(before["draft"] + 1)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("UPLOADED"), line
        dead_id = line.split()[1]
    finally:
        proc.kill()
        proc.wait(30)
    killed_at = time.time()
    draft = load_file(warm_draft / "model.safetensors")
    impatient = EngineClient(server.url, api_key=KEY, progress=False, begin_wait_s=0)
    with pytest.raises(WeightSyncError, match=f"HTTP 409: update {dead_id}.*in progress.*aborted by the next begin"):
        impatient.update_draft(draft, version=before["draft"] + 1)
    status = client.status()
    assert list(status["updates_in_progress"]) == [dead_id]
    assert status["workers"][0]["sync"]["in_progress"]["update_id"] == dead_id
    assert served_texts(server, prompts) == texts and versions(client) == before  # serving goes on
    assert time.time() - killed_at < IDLE_TIMEOUT_S - 1, "too slow to see the open update before its timeout"
    res = client.update_draft(draft, version=before["draft"] + 1)  # waits until the dead one is abandoned
    assert res["version"] == before["draft"] + 1 and time.time() - spawned_at > IDLE_TIMEOUT_S
    status = client.status()
    assert status["abandoned_updates_total"] == 1 and status["abandoned_updates"][0]["update_id"] == dead_id
    assert status["abandoned_updates"][0]["idle_s"] >= IDLE_TIMEOUT_S
    assert status["abandoned_updates"][0]["aborted"] and status["updates_in_progress"] == {}
    assert status["versions"] == {"policy": before["policy"], "draft": before["draft"] + 1}
    assert served_texts(server, prompts) == texts  # the same draft again: lossless either way


def test_two_writers_take_turns(server, client, warm_draft, original):
    """The RL loop's policy update begun while the online trainer's draft update is open waits for
    it and then commits: neither writer sees an error, both versions land."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    before = versions(client)
    draft = load_file(warm_draft / "model.safetensors")
    trainer = EngineClient(server.url, api_key=KEY, progress=False)
    staged = trainer.stage("draft", draft, before["draft"] + 1)  # open, not yet committed
    with ThreadPoolExecutor(1) as pool:
        policy = pool.submit(client.update_policy, original, before["policy"] + 1)
        time.sleep(1.0)
        assert not policy.done(), "the policy update did not wait for the open draft update"
        assert list(client.status()["updates_in_progress"]) == [staged["update_id"]]
        trainer.commit(staged)
        res = policy.result(timeout=120)
    assert res["version"] == before["policy"] + 1
    assert versions(client) == {"policy": before["policy"] + 1, "draft": before["draft"] + 1}


def test_updates_under_load_fail_no_request(server, client, original, new_policy):
    """Concurrent OpenAI requests while policy updates commit, in each pause mode."""
    new = load_file(new_policy / "model.safetensors")
    stop, results, errors = threading.Event(), [], []

    def worker(i: int) -> None:
        while not stop.is_set():
            try:
                r = requests.post(server.url + "/v1/completions", headers=server.headers, timeout=300,
                                  json={"model": server.model, "prompt": f"def f{i}(x):",
                                        "max_tokens": 24, "temperature": 1.0, "ignore_eos": True})
                results.append((r.status_code, r.headers.get("x-specrl-policy-version-start"),
                                r.headers.get("x-specrl-policy-version")))
            except requests.RequestException as exc:  # pragma: no cover - reported below
                errors.append(repr(exc))

    first = versions(client)["policy"]
    with ThreadPoolExecutor(6) as pool:
        try:
            for i in range(6):
                pool.submit(worker, i)
            for version, (weights, mode) in enumerate([(new, "wait"), (original, "keep"), (new, "none")], first + 1):
                res = client.update_policy(weights, version=version, pause=mode)
                assert res["version"] == version
        finally:
            stop.set()
    assert not errors, errors[:3]
    assert results and all(code == 200 for code, _, _ in results), results
    assert all(first <= int(s) <= int(e) <= first + 3 for _, s, e in results), results
    assert {e for _, _, e in results} - {str(first)}, "no request completed after the first commit"
    assert versions(client)["policy"] == first + 3


def test_auto_transport_follows_what_the_engine_reads(server, monkeypatch):
    """``auto`` picks shared memory only when every worker reads the client's probe file: a client in
    another container has its own ``/dev/shm``, where the same path names a file the engine lacks."""
    from vllm_specrl.sync import shm

    assert EngineClient(server.url, api_key=KEY, progress=False).resolved_transport() == "shm"
    written = shm.write_probe

    def in_another_container():
        path, token = written()
        path.unlink()
        return path, token

    monkeypatch.setattr(shm, "write_probe", in_another_container)
    assert EngineClient(server.url, api_key=KEY, progress=False).resolved_transport() == "http"


def test_the_key_comes_from_the_environment_and_a_refused_key_says_so(server, monkeypatch):
    from vllm_specrl.sync.clients.response_check import API_KEY_ENV, EngineKeyRefused

    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert EngineClient(server.url, progress=False).status()["versions"]
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(EngineKeyRefused, match=API_KEY_ENV):
        EngineClient(server.url, progress=False).status()


def test_the_draft_trainer_takes_the_key_and_stops_at_once_without_it(server, tiny_model, random_draft, tmp_path,
                                                                     monkeypatch):
    """A keyed engine: the online trainer started without the key stops at start-up saying why (it used to
    answer every publish's 401 by trying again, silently); with it, it starts."""
    from vllm_specrl.rl.draft_trainer import DraftTrainerProcess, DraftTrainerSettings
    from vllm_specrl.sync.clients.response_check import API_KEY_ENV
    from vllm_specrl.launcher import free_port

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    settings = DraftTrainerSettings(mixed_precision="no", sched_idle=False)
    with pytest.raises(RuntimeError, match="HTTP 401"):
        DraftTrainerProcess.start(f"tcp://127.0.0.1:{free_port()}", server.url, random_draft, tiny_model,
                                  tmp_path / "keyless", settings)
    trainer = DraftTrainerProcess.start(f"tcp://127.0.0.1:{free_port()}", server.url, random_draft, tiny_model,
                                        tmp_path / "keyed", settings, api_key=KEY)
    assert trainer.stop(60)
