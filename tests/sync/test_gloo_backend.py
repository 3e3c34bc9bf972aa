"""``specrl_gloo``: one trainer rank broadcasts each tensor once to every worker of every engine, through
vLLM's own weight-transfer factories and routes, all engines or none.

Three ``vllm serve`` replicas of the tiny model with ``--weight-transfer-config '{"backend":"specrl_gloo"}'``:
A with two tensor-parallel workers, B and C with one. The trainer (this process) drives them as one
``EngineGroup`` through ``WeightTransferTrainerFactory.trainer_init``: a round to A and B lands on all
three workers (their greedy outputs equal a fresh engine's on the new weights, and both say the
labelled version); a round to A and C, where C refuses (a failpoint: as a validation failure would),
is aborted on A too, nothing applied anywhere and no version moved, and the next round lands on both.

What would fail: a worker left out of the broadcast (a hang, or old outputs on one TP rank), outputs
that differ from a fresh engine on the same weights, a refusal on one engine that still lets another
apply, a version that moves for an aborted round.

Engines: three ``vllm serve`` (A: TP=2), started side by side; a fresh in-process engine for the reference.
"""

from __future__ import annotations

import json

import pytest
import requests
import torch

from helpers import perturbed_checkpoint
from sampling import greedy_generate
from vllm_specrl.faults import FAULTS_ENV
from vllm_specrl.launcher import VLLMServer, cpu_env, free_port, started

pytestmark = pytest.mark.server
PROMPTS = ["def add(a, b):", "import sys\n", "class Point:"]
TOKENS = 12


@pytest.fixture(scope="module")
def replicas(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("gloo")
    args = ["--dtype", "float32", "--max-model-len", "256", "--weight-transfer-config",
            json.dumps({"backend": "specrl_gloo"})]
    dev = {"VLLM_SERVER_DEV_MODE": "1"}
    with started(VLLMServer(tiny_model, [*args, "--tensor-parallel-size", "2"], log_path=work / "a.log",
                            env=dict(cpu_env(), **dev, VLLM_CPU_OMP_THREADS_BIND="0|1")),
                 VLLMServer(tiny_model, args, log_path=work / "b.log", env=dict(cpu_env(), **dev)),
                 VLLMServer(tiny_model, args, log_path=work / "c.log",
                            env=dict(cpu_env(), **dev, **{FAULTS_ENV: "refuse:policy:1:0"}))) as servers:
        yield servers


def served(server) -> tuple[list[list[int]], str]:
    r = requests.post(server.url + "/v1/completions", timeout=300, json={
        "model": server.model, "prompt": PROMPTS, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    r.raise_for_status()
    return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])], \
        r.headers["x-specrl-policy-version"]


def trainer(servers, workers):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_specrl.sync.clients.engine_client import EngineClient
    from vllm_specrl.sync.clients.engine_group import EngineGroup
    from vllm_specrl.sync.backends.gloo_backend import GlooTrainerInitInfo
    from vllm_specrl.sync.backends.registration import register_gloo_weight_transfer_backend

    register_gloo_weight_transfer_backend()
    group = EngineGroup([EngineClient(s.url, progress=False) for s in servers], workers)
    return group, lambda source: WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo("127.0.0.1", free_port(), group.world_size, rank=0, timeout_s=120),
        client=group, source=source)


def hf_source(checkpoint):
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource

    return ModuleSource(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32))


def test_one_broadcast_reaches_every_worker_of_every_engine(replicas, tiny_model, tmp_path):
    a, b, _ = replicas
    moved = perturbed_checkpoint(tiny_model, tmp_path / "moved", seed=11)
    expected = greedy_generate(moved, PROMPTS, TOKENS)["tokens"]
    assert served(a)[0] != expected
    _, init = trainer([a, b], [2, 1])
    engine = init(hf_source(moved))
    engine.send_weights(weight_version="3")
    for server in (a, b):
        assert served(server) == (expected, "3"), server.url


def test_a_refusal_on_one_engine_aborts_the_round_on_all(replicas, tiny_model, tmp_path):
    from vllm_specrl.sync.clients.engine_group import EngineGroupError

    a, _, c = replicas
    before = {s.url: served(s) for s in (a, c)}
    _, init = trainer([a, c], [2, 1])
    engine = init(hf_source(perturbed_checkpoint(tiny_model, tmp_path / "other", seed=12)))
    with pytest.raises(EngineGroupError) as err:
        engine.send_weights(weight_version="9")
    assert list(err.value.engines) == [1] and "injected refusal" in err.value.engines[1], err.value.engines
    for server in (a, c):
        assert served(server) == before[server.url], server.url
        status = requests.get(server.url + "/specrl/status", timeout=60).json()
        assert status["versions"]["policy"] == int(before[server.url][1]), status["versions"]
    # the aborted round left no session open anywhere: the next round lands on both
    back = perturbed_checkpoint(tiny_model, tmp_path / "next", seed=13)
    init(hf_source(back)).send_weights(weight_version="10")
    expected = greedy_generate(back, PROMPTS, TOKENS)["tokens"]
    for server in (a, c):
        assert served(server) == (expected, "10"), server.url
