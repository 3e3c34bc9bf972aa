"""`vllm serve` with the plugin: OpenAI routes with logprobs, /specrl/status, the API key.

One real server (default multi-process mode, so API server, engine core and
worker are three processes) with the history proposer (``custom_class``: drafts from a
request's own text, its siblings and earlier rollouts of its prompt) and adaptive k,
shared by the module.

Engines: one `vllm serve` in default multi-process mode for the module: the OpenAI routes and the
API key are served there.
"""

from __future__ import annotations

import re

import pytest
import requests
from openai import OpenAI

from vllm_specrl.adaptive import SCHEDULER_CLS
from vllm_specrl.launcher import VLLMServer

pytestmark = pytest.mark.server
API_KEY = "test-key"
SPEC = ('{"method":"custom_class","model":"vllm_specrl.proposer.history.HistoryProposer",'
        '"num_speculative_tokens":3}')
HISTORY_KNOBS = '{"specrl":{"history":{"max_sequences":16}}}'
REPETITIVE = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\nw = [1, 2, 3]\nv ="


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "vllm_serve.log"
    args = ["--dtype", "float32", "--max-model-len", "1024", "--speculative-config", SPEC,
            "--additional-config", HISTORY_KNOBS, "--scheduler-cls", SCHEDULER_CLS]
    with VLLMServer(tiny_model, args, api_key=API_KEY, log_path=log) as srv:
        srv.log = log
        yield srv


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


def prometheus_values(text: str) -> dict[str, float]:
    """``name{labels}`` -> value from /metrics, labels other than ``position`` dropped, summed."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$', line)
        if not m:
            continue
        pos = re.search(r'position="(\d+)"', m.group(2) or "")
        key = m.group(1) + (f'{{position="{pos.group(1)}"}}' if pos else "")
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def test_completions_with_logprobs(server, client):
    resp = client.completions.create(model=server.model, prompt=REPETITIVE, max_tokens=16,
                                     temperature=0, logprobs=2)
    choice = resp.choices[0]
    assert resp.usage.completion_tokens == len(choice.logprobs.token_logprobs) > 0
    assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)
    assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs)


def test_chat_completions_with_logprobs_and_groups(server, client):
    resp = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "def main():"}], n=4,
        temperature=1.0, max_tokens=12, logprobs=True, top_logprobs=1, seed=7)
    assert len(resp.choices) == 4
    for choice in resp.choices:
        assert 0 < len(choice.logprobs.content) <= 12
        assert all(t.logprob <= 0.0 for t in choice.logprobs.content)


def test_status_requires_the_api_key(server):
    url = server.url + "/specrl/status"
    assert requests.get(url, timeout=30).status_code == 401
    assert requests.get(url, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    assert requests.get(url, headers={"Authorization": API_KEY}, timeout=30).status_code == 401
    assert requests.get(url, headers=server.headers, timeout=30).status_code == 200


def test_status_reports_versions_worker_and_spec_config(server, client):
    # Greedy on a repetitive prompt: the history proposer drafts from the request's own text.
    client.completions.create(model=server.model, prompt=REPETITIVE, max_tokens=32, temperature=0)
    status = server.status()
    assert status["vllm_specrl"] and status["vllm"].startswith("0.32")
    assert status["api_server"]["plugin"]["status"] == "active"
    (worker,) = status["workers"]
    assert worker["plugin"]["status"] == "active" and worker["plugin"]["role"] == "worker"
    assert worker["pid"] != status["api_server"]["pid"], "worker must be another process"
    assert worker["model"] == "LlamaForCausalLM" and worker["drafter"] == "HistoryProposer"
    # The worker's registered patches and their state there (CPU platform: the CPU-scoped ones too).
    from vllm_specrl import patches as package_patches
    from vllm_specrl.compat.registry import REGISTRY

    assert worker["plugin"]["platform"] == "cpu" and status["ineffective_switches"] == []
    patches = {row["name"]: row for row in worker["plugin"]["patches"]}
    assert set(patches) == {patch.name for patch in REGISTRY.patches()}, package_patches  # every one listed
    for name in ("custom_proposer_binding", "deferred_draft_kv", "zero_draft_plain_sampler", "cpu_expand_kernel_fix",
                 "cpu_fast_sampling.one_pass_verify"):
        assert patches[name]["state"] == "installed" and patches[name]["switch"].startswith("VLLM_SPECRL_"), patches
    assert patches["capture_tap"]["state"] == "declared" and not any(p["state"] == "failed" for p in patches.values())
    # The proposer's index, from the worker process: the chat group above (n=4) was kept once it
    # finished, under the knob passed with --additional-config.
    history = worker["proposer"]
    assert history["proposer"] == "history" and history["config"]["max_sequences"] == 16, history
    assert history["completions"] >= 4 and 0 < history["bytes"] <= history["max_bytes"], history
    spec = status["speculative_config"]
    assert spec["method"] == "custom_class" and spec["num_speculative_tokens"] == 3
    sd = status["spec_decode"]
    # Against vLLM's own counters as /metrics renders them (no traffic in between).
    raw = prometheus_values(requests.get(server.url + "/metrics", timeout=30).text)
    drafts, accepted = raw["vllm:spec_decode_num_drafts_total"], raw["vllm:spec_decode_num_accepted_tokens_total"]
    assert sd["num_drafts"] == drafts > 0 and sd["num_accepted_tokens"] == accepted > 0  # drafts on a repeat
    assert sd["num_draft_tokens"] == raw["vllm:spec_decode_num_draft_tokens_total"]
    assert sd["acceptance_length"] == pytest.approx(1 + accepted / drafts)
    per_pos = [raw[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}'] / drafts for j in range(3)]
    assert sd["per_position_acceptance"] == pytest.approx(per_pos)
    assert sd["acceptance_rate"] == pytest.approx(accepted / sd["num_draft_tokens"])


def test_adaptive_k_state_reaches_status_and_metrics(server, client):
    """The controller runs in the engine-core process; the API server reports it."""
    client.completions.create(model=server.model, prompt=REPETITIVE, max_tokens=48, temperature=0)
    adaptive = server.status()["adaptive_k"]
    assert adaptive is not None and adaptive["max_k"] == 3
    # The runner's step time crossed from the worker process to the engine core's scheduler.
    assert adaptive["step_overhead_ms"] is not None, adaptive
    counts = adaptive["chosen_k_counts"]
    assert sum(counts) >= 48 / 4, adaptive  # at least one step per 4 tokens was scheduled
    text = requests.get(server.url + "/metrics", timeout=30).text
    for k, n in enumerate(counts):
        assert f'specrl_adaptive_k_steps{{engine="0",k="{k}"}} {float(n)}' in text, (k, n)
    assert f'specrl_adaptive_k{{engine="0"}} {float(adaptive["last_k"])}' in text


def test_plugin_ran_in_api_server_engine_core_and_worker(server):
    lines = server.log.read_text().splitlines()
    roles = {}
    for line in lines:
        m = re.search(r"plugin active in (\w+) process \(pid (\d+)", line)
        if m:
            roles[m.group(1)] = int(m.group(2))
    assert set(roles) == {"main", "engine_core", "worker"}, roles
    assert len(set(roles.values())) == 3, f"three distinct processes expected: {roles}"
    assert roles["main"] == server.status()["api_server"]["pid"]


def test_a_trainer_report_without_an_update_reaches_status_and_metrics(server):
    """What the online trainer sends when its publish gate keeps the served draft."""
    from vllm_specrl.sync.clients.engine_client import EngineClient

    url = server.url + "/specrl/draft_trainer"
    assert requests.post(url, json={"capture": {}}, timeout=30).status_code == 401  # the key is required
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert requests.post(url, json=[1, 2], headers=auth, timeout=30).status_code == 400
    report = {"capture": {"ingested": 12, "drops": {"other_policy_version": 2}}, "steps": 20,
              "publish_gate": {"held_out": 4, "offered": 16, "better": 1, "not_better": 3, "too_few_held_out": 2}}
    EngineClient(server.url, api_key=API_KEY, progress=False).report_trainer(report)
    status = requests.get(server.url + "/specrl/status", headers=auth, timeout=30).json()
    assert {k: v for k, v in status["draft_trainer"].items() if k != "received_at"} == report
    text = requests.get(server.url + "/metrics", timeout=30).text
    for line in ('specrl_draft_publish_gate{verdict="not_better"} 3.0',
                 'specrl_draft_publish_gate{verdict="too_few_held_out"} 2.0',
                 'specrl_draft_trainer_requests{outcome="dropped_other_policy_version"} 2.0'):
        assert line in text, [m for m in text.splitlines() if m.startswith("specrl_draft")]
