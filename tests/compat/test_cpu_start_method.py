"""``VLLM_SPECRL_CPU_START_METHOD=fork``: ``vllm serve`` forks its engine core and worker on CPU.

vLLM's CPU platform always spawns them (each re-imports vLLM); forked, the plugin must still run
in each of them as its own process, with the worker's own registrations, and the engine must
answer exactly as a spawned one does. Two servers side by side, one each way.

Engines: two `vllm serve` side by side, one forked and one spawned: the comparison under test.
"""

from __future__ import annotations

import psutil
import pytest
import requests

from vllm_specrl.cpu import start_method as cpu_start_method
from vllm_specrl.launcher import VLLMServer, cpu_env, started

pytestmark = pytest.mark.server
SPEC = ('{"method":"custom_class","model":"vllm_specrl.proposer.history.HistoryProposer",'
        '"num_speculative_tokens":3}')
PROMPTS = ["def add(a, b):\n    return", "x = [1, 2, 3]\ny = [1, 2, 3]\nz =", "The capital of France is"]


def env_for(method: str | None) -> dict[str, str]:
    env = cpu_env()
    env.pop(cpu_start_method.CPU_START_METHOD_ENV, None)
    if method:
        env[cpu_start_method.CPU_START_METHOD_ENV] = method
    return env


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("start_method")
    args = ["--dtype", "float32", "--max-model-len", "512", "--speculative-config", SPEC]
    fork = VLLMServer(tiny_model, args, log_path=logs / "fork.log", env=env_for("fork"))
    spawn = VLLMServer(tiny_model, args, log_path=logs / "spawn.log", env=env_for(None))
    with started(fork, spawn):
        yield {"fork": fork, "spawn": spawn}


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_plugin_runs_in_each_process_as_its_own(servers, method):
    status = servers[method].status()
    (worker,) = status["workers"]
    assert worker["plugin"]["status"] == "active" and worker["plugin"]["role"] == "worker", worker["plugin"]
    assert worker["plugin"]["pid"] == worker["pid"] != status["api_server"]["pid"]
    assert worker["plugin"]["forked"] is (method == "fork") and status["api_server"]["plugin"]["forked"] is False
    # engine core and worker: processes of their own under `vllm serve`
    children = psutil.Process(servers[method].proc.pid).children(recursive=True)
    assert {"VLLM::EngineCore", "VLLM::Worker"} <= {c.cmdline()[0] for c in children}
    registrations = dict(r.split(": ", 1) for r in worker["plugin"]["registrations"])
    # a forked worker finds its engine core's patches installed already: installed, not failed
    assert not {k: v for k, v in registrations.items() if v.startswith("failed")}, registrations
    # worker-side fixes run in the worker, which the API server's registrations never do
    assert registrations["cpu_fast_sampling"] == registrations["custom_proposer_binding"] == "installed"
    assert registrations["cpu_start_method"].startswith("engine processes started by fork" if method == "fork"
                                                        else "skipped: not requested")
    assert worker["drafter"] == "HistoryProposer"


def greedy(server: VLLMServer) -> list[tuple[list[int], list[float]]]:
    body = {"model": server.model, "prompt": PROMPTS, "max_tokens": 24, "ignore_eos": True, "temperature": 0.0,
            "logprobs": 1, "return_token_ids": True}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]


def test_a_forked_engine_answers_as_a_spawned_one(servers):
    """Greedy answers (history drafts verified) token for token, with the same log-probabilities."""
    fork, spawn = greedy(servers["fork"]), greedy(servers["spawn"])
    for (tokens_f, logprobs_f), (tokens_s, logprobs_s) in zip(fork, spawn, strict=True):
        assert tokens_f == tokens_s and len(tokens_f) == 24
        assert logprobs_f == pytest.approx(logprobs_s, abs=1e-4)


def test_an_unknown_start_method_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(cpu_start_method.CPU_START_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match="expected one of"):
        cpu_start_method.requested_cpu_start_method()
    monkeypatch.setenv(cpu_start_method.CPU_START_METHOD_ENV, " Fork ")
    assert cpu_start_method.requested_cpu_start_method() == "fork"
