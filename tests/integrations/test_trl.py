"""TRL's GRPOTrainer rolls out through a speculative ``vllm serve`` and syncs through vllm-specrl.

A few real GRPO steps of TRL 1.16 on the tiny fixture (float32, CPU) against
one server with the warm EAGLE-3 draft and an API key. What must hold: the
trainer runs its steps, every sync lands as one policy version, the rollouts
were speculated, and afterwards the served weights are the trained ones (the
logprobs vLLM reports for its greedy tokens equal the trained HF model's and
differ from the original model's).

Engines: one `vllm serve` for the module: TRL's GRPOTrainer talks to a server, as it does in a real
job.
"""

from __future__ import annotations

import json
import shutil

import pytest
import requests
import torch

from prompts import code_prompts
from vllm_specrl.launcher import VLLMServer

pytestmark = pytest.mark.server
trl = pytest.importorskip("trl")
KEY = "trl-key"
STEPS = 3


@pytest.fixture(scope="module")
def server(tiny_model, warm_draft, tmp_path_factory):
    log = tmp_path_factory.mktemp("trl_server") / "vllm_serve.log"
    spec = {"method": "eagle3", "model": str(warm_draft), "num_speculative_tokens": 3}
    args = ["--dtype", "float32", "--max-model-len", "512", "--speculative-config", json.dumps(spec),
            "--logprobs-mode", "processed_logprobs", "--seed", "0"]
    with VLLMServer(tiny_model, args, api_key=KEY, log_path=log) as srv:
        yield srv


def digit_reward(completions: list[str], **_: object) -> list[float]:
    """A verifiable reward the tiny model can move: the share of characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


@pytest.fixture(scope="module")
def trained(server, tiny_model, tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from vllm_specrl.integrations.trl import use_specrl

    work = tmp_path_factory.mktemp("trl_run")
    model_dir = work / "policy"
    shutil.copytree(tiny_model, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(work / "out"), use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=12, max_steps=STEPS,
        learning_rate=3e-3, beta=0.0, use_cpu=True, bf16=False, report_to=[], logging_steps=1,
        save_strategy="no", seed=0, dataloader_num_workers=0)
    dataset = Dataset.from_list([{"prompt": p} for p in code_prompts(16)])
    with use_specrl(api_key=KEY) as patch:
        trainer = GRPOTrainer(model=model, reward_funcs=digit_reward, args=config, train_dataset=dataset,
                              processing_class=tok)
        status_before = requests.get(server.url + "/specrl/status", headers=server.headers, timeout=60).json()
        trainer.train()
        # TRL syncs before each rollout, so the last optimizer step is not served yet; push it as a
        # user would before evaluating on the server.
        trainer.vllm_generation.sync_weights()
        client = trainer.vllm_generation.vllm_client
    status_after = requests.get(server.url + "/specrl/status", headers=server.headers, timeout=60).json()
    return {"patch": patch, "trainer": trainer, "client": client, "model": model, "tok": tok,
            "before": status_before, "after": status_after, "original": model_dir}


def test_trainer_ran_on_the_specrl_client(trained):
    from vllm_specrl.integrations.trl import SpecRLVLLMClient

    assert isinstance(trained["client"], SpecRLVLLMClient)
    assert trained["trainer"].state.global_step == STEPS
    losses = [h for h in trained["trainer"].state.log_history if "loss" in h]
    assert len(losses) == STEPS


def test_every_sync_is_one_policy_version(trained):
    client, after = trained["client"], trained["after"]
    # TRL syncs before every rollout (the first one included), plus the final sync of the fixture.
    assert client.syncs >= STEPS + 1
    start = trained["before"]["versions"]["policy"]
    assert after["versions"]["policy"] == client.policy_version == start + client.syncs
    assert after["updates_in_progress"] == {}


def test_rollouts_were_speculated(trained):
    before, after = trained["before"]["spec_decode"], trained["after"]["spec_decode"]
    drafts = after["num_drafts"] - before["num_drafts"]
    assert drafts > 0
    assert after["num_accepted_tokens"] - before["num_accepted_tokens"] > 0


def _served_greedy(server, prompts, max_tokens=8):
    r = requests.post(server.url + "/v1/completions", headers=server.headers, timeout=300, json={
        "model": server.model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_token_ids": True})
    r.raise_for_status()
    return [(c["prompt_token_ids"], c["token_ids"], c["logprobs"]["token_logprobs"])
            for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def _hf_logprobs(model, prompt_ids, completion_ids) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(prompt_ids) - 1:]


def test_served_weights_are_the_trained_weights(server, trained):
    from transformers import AutoModelForCausalLM

    trained_model = trained["model"].eval()
    original = AutoModelForCausalLM.from_pretrained(trained["original"], dtype=torch.float32).eval()
    moved = 0.0
    for prompt_ids, completion_ids, served in _served_greedy(server, code_prompts(20)[16:]):
        served = torch.tensor(served)
        assert torch.allclose(_hf_logprobs(trained_model, prompt_ids, completion_ids), served, atol=2e-3)
        moved = max(moved, float((_hf_logprobs(original, prompt_ids, completion_ids) - served).abs().max()))
    assert moved > 1e-2, "training did not move the policy enough for this check to mean anything"


def test_use_specrl_undoes_its_patch(trained):
    from trl.generation import vllm_client, vllm_generation

    assert vllm_generation.VLLMClient is vllm_client.VLLMClient
