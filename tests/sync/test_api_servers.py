"""Several API servers behind one port (``vllm serve --api-server-count 2``): what a user reported
broken, each checked from every process.

An update's begin, chunks and commit go over fresh connections, so the kernel hands them to either API
server; afterwards every completion, whichever process answers, carries the committed version in
``x-specrl-policy-version``, and ``/specrl/status`` and ``/metrics`` say the same from both processes
(versions, the spec-decode counters summed over both, adaptive k from the one engine core). Planted once:
versions kept per process (the pre-fix design) -> the header test sees stale versions.

The server keeps no rollback point for the policy (``"policy_rollback": false``, the setting for a policy
too large for two host copies): nothing is held after a commit, and an update that fails part way leaves
generation paused (never a half-applied policy served) until a complete update commits.

Engines: one `vllm serve --api-server-count 2` for the module (tiny target, float32, EAGLE-3 k=3, adaptive
k, no policy rollback point): the layout under test, which no other module starts.
"""

from __future__ import annotations

import json
import re

import pytest
import requests
from safetensors.torch import load_file

from conftest import WARM_DRAFT_VOCAB
from vllm_specrl.adaptive import SCHEDULER_CLS
from vllm_specrl.proposer.checkpoint import init_draft
from vllm_specrl.faults import FAULTS_ENV
from vllm_specrl.launcher import VLLMServer, cpu_env
from vllm_specrl.sync.clients.engine_client import EngineClient, WeightSyncError

pytestmark = pytest.mark.server
API_KEY = "two-servers"
UPDATES = 3
FAILS_APPLYING = 90  # the loader fails part way through this policy version
REQUESTS = 16  # fresh connections: both processes answer some (2 ** -15 that one answers all)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("api2")
    init_draft(tiny_model, work / "draft", WARM_DRAFT_VOCAB, seed=6)
    spec = {"method": "eagle3", "model": str(work / "draft"), "num_speculative_tokens": 3}
    args = ["--dtype", "float32", "--max-model-len", "256", "--api-server-count", "2",
            "--speculative-config", json.dumps(spec), "--scheduler-cls", SCHEDULER_CLS,
            "--additional-config", json.dumps({"specrl": {"policy_rollback": False}})]
    env = dict(cpu_env(), **{FAULTS_ENV: f"apply:policy:{FAILS_APPLYING}:5"})
    with VLLMServer(tiny_model, args, api_key=API_KEY, env=env, log_path=work / "serve.log") as srv:
        yield srv


def fresh_connections(client: EngineClient) -> list[tuple[str, str]]:
    """Every request on a new connection; returns the (path, answering pid) log it fills."""
    answered: list[tuple[str, str]] = []
    client.session.headers["Connection"] = "close"
    client.session.hooks["response"].append(
        lambda r, *a, **k: answered.append((r.request.path_url, r.headers.get("x-specrl-api-server"))))
    return answered


def completion(server) -> requests.Response:
    r = requests.post(server.url + "/v1/completions", headers=dict(server.headers, Connection="close"),
                      timeout=300, json={"model": server.model, "prompt": "def f(x):", "max_tokens": 8,
                                         "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r


def from_every_process(server, path: str, want: int = 2, tries: int = 40) -> dict[str, requests.Response]:
    """One answer per API-server pid."""
    out: dict[str, requests.Response] = {}
    for _ in range(tries):
        r = requests.get(server.url + path, headers=dict(server.headers, Connection="close"), timeout=60)
        r.raise_for_status()
        out.setdefault(r.headers["x-specrl-api-server"], r)
        if len(out) >= want:
            break
    return out


@pytest.fixture(scope="module")
def updated(server, tiny_model):
    """Three policy updates, each begun, uploaded in chunks and committed over fresh connections."""
    client = EngineClient(server.url, api_key=API_KEY, transport="http", chunk_bytes=256 * 1024, progress=False)
    answered = fresh_connections(client)
    weights = load_file(tiny_model / "model.safetensors")
    for version in range(1, UPDATES + 1):
        client.update_policy(weights, version=version)
    return answered


def test_an_update_spread_over_both_processes_commits(updated):
    update_calls = [(path, pid) for path, pid in updated if "/specrl/update/" in path]
    assert len({pid for _, pid in update_calls}) == 2, update_calls  # chunks and commits on both
    commits = [pid for path, pid in update_calls if path.endswith("/commit")]
    begins = [pid for path, pid in update_calls if path.endswith("/begin")]
    assert len(commits) == UPDATES and len(begins) == UPDATES


def test_every_completion_says_the_committed_version(server, updated):
    seen = {}
    for _ in range(REQUESTS):
        r = completion(server)
        seen.setdefault(r.headers["x-specrl-api-server"], set()).add(
            (r.headers["x-specrl-policy-version-start"], r.headers["x-specrl-policy-version"]))
    assert len(seen) == 2, seen
    assert all(versions == {(str(UPDATES), str(UPDATES))} for versions in seen.values()), seen


def test_status_agrees_from_every_process(server, updated):
    completion(server)
    answers = from_every_process(server, "/specrl/status")
    assert len(answers) == 2
    statuses = [r.json() for r in answers.values()]
    assert all(s["versions"] == {"policy": UPDATES, "draft": 0} for s in statuses), statuses
    assert all(s["api_server"]["several"] for s in statuses)
    assert {s["api_server"]["pid"] for s in statuses} == {int(pid) for pid in answers}
    assert all(s["updates_in_progress"] == {} and s["last_commit_failure"] is None for s in statuses)
    adaptive = [s["adaptive_k"] for s in statuses]
    assert all(a is not None and a["max_k"] == 3 for a in adaptive), adaptive
    drafts = {s["spec_decode"]["num_drafts"] for s in statuses}
    assert len(drafts) == 1 and drafts.pop() > 0  # both processes' counters, summed, from either


def metric(text: str, name: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]


def test_metrics_agree_from_every_process(server, updated):
    completion(server)
    pages = [r.text for r in from_every_process(server, "/metrics").values()]
    assert len(pages) == 2
    for page in pages:
        assert metric(page, "specrl_policy_version") == [float(UPDATES)], metric(page, "specrl_policy_version")
        assert metric(page, "specrl_draft_version") == [0.0]
        assert metric(page, 'specrl_adaptive_k') and all(v >= 0 for v in metric(page, "specrl_adaptive_k"))
    drafts = [sum(metric(page, "vllm:spec_decode_num_drafts_total")) for page in pages]
    assert drafts[0] == drafts[1] > 0, drafts


def test_without_a_rollback_point_nothing_is_held_and_a_failed_apply_pauses(server, updated, tiny_model):
    client = EngineClient(server.url, api_key=API_KEY, progress=False)
    for worker in client.status()["workers"]:
        held = worker["sync"]["host_bytes"]
        # nothing of the policy is held; what is, is the draft's host copy (the drafter's repair source)
        assert held["last_good"]["policy"] == 0 and held["keep_last_good"]["policy"] is False, held
        assert held["total"] == held["last_good"]["draft"], held
    weights = load_file(tiny_model / "model.safetensors")
    with pytest.raises(WeightSyncError, match="no rollback point"):
        client.update_policy(weights, version=FAILS_APPLYING)
    statuses = [r.json() for r in from_every_process(server, "/specrl/status").values()]
    assert all(s["generation_paused"] and s["last_commit_failure"]["no_rollback_point"] for s in statuses)
    assert all(s["versions"]["policy"] == UPDATES for s in statuses)
    client.update_policy(weights, version=FAILS_APPLYING + 1)  # the retry: complete, it commits and resumes
    assert not client.status()["generation_paused"]
    assert completion(server).headers["x-specrl-policy-version"] == str(FAILS_APPLYING + 1)
