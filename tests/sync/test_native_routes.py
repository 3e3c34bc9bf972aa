"""vLLM's own RL routes on ``vllm serve`` keep the plugin's guarantees (``sync.watch.api_server``).

The case a user reported: the tiny model served with an EAGLE-3 draft, ``VLLM_SERVER_DEV_MODE=1`` and
``--weight-transfer-config '{"backend":"specrl_shm"}'``. A policy update through ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update`` with ``weight_version: "7"`` shows as version 7 in the
response headers, ``/specrl/status`` and the captured frames, and the stale-draft guard reports the
draft's lag; a draft update through ``/start_draft_weight_update`` whose ``d2t`` maps outside the
vocabulary is refused with the reason and every completion after it still answers, unchanged; a valid
draft update labelled ``7`` through ``/update_weight_version`` leaves no lag.

What would fail: headers or status still at 0 after the native update, frames stamped with the old
version, a guard that sees no lag, completions failing (HTTP 500) or changed after the refused draft.

Engines: one ``vllm serve`` (tiny model, float32, random EAGLE-3 draft with a reduced vocabulary).
"""

from __future__ import annotations

import json
import time

import pytest
import requests
from safetensors.torch import load_file

from helpers import perturbed_checkpoint
from vllm_specrl.launcher import VLLMServer, cpu_env, free_port
from vllm_specrl.sync.shm import write_chunk

pytestmark = pytest.mark.server
PROMPTS = ["def add(a, b):", "import sys\n", "class Point:"]


@pytest.fixture(scope="module")
def capture_address():
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def draft(tiny_model, tmp_path_factory):
    from vllm_specrl.proposer.checkpoint import init_draft

    out = tmp_path_factory.mktemp("draft") / "eagle3"
    init_draft(tiny_model, out, 1024, seed=0)
    return out


@pytest.fixture(scope="module")
def server(tiny_model, draft, capture_address, tmp_path_factory):
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}
    args = ["--dtype", "float32", "--max-model-len", "512", "--speculative-config", json.dumps(spec),
            "--weight-transfer-config", json.dumps({"backend": "specrl_shm"}),
            "--additional-config", json.dumps({"specrl": {"capture": capture_address}})]
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with VLLMServer(tiny_model, args, log_path=log, env={**cpu_env(), "VLLM_SERVER_DEV_MODE": "1"}) as srv:
        yield srv


def post(server, path: str, **body) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=300)


def complete(server) -> tuple[list[list[int]], requests.Response]:
    r = post(server, "/v1/completions", model=server.model, prompt=PROMPTS, max_tokens=12, temperature=0,
             ignore_eos=True, return_token_ids=True)
    r.raise_for_status()
    return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])], r


def native_update(server, tensors: dict, draft: bool = False, weight_version: str | None = None) -> requests.Response:
    """The four native steps; the response of the first that fails, else of the last."""
    paths = [write_chunk(tensors)]
    try:
        for path, body in [("/init_weight_transfer_engine", {"init_info": {}}),
                           ("/start_draft_weight_update" if draft else "/start_weight_update", {}),
                           ("/update_weights", {"update_info": {"paths": [str(p) for p in paths]}}),
                           ("/finish_weight_update", {"weight_version": weight_version} if weight_version else {})]:
            r = post(server, path, **body)
            if r.status_code != 200:
                return r
        return r
    finally:
        for p in paths:
            p.unlink(missing_ok=True)


def drain(receiver, wanted: int = 0) -> set:
    """The policy versions of the frames that arrive until ``wanted`` requests are whole and the
    stream is quiet."""
    from vllm_specrl.capture.receiver import SequenceAssembler

    assembler, deadline = SequenceAssembler(), time.time() + 30
    while time.time() < deadline and (len(assembler.requests) < wanted or receiver.pending(1000)):
        for header, tensors in receiver.receive(200):
            assembler.add(header, tensors)
    return {v for rows in assembler.requests.values() for v in rows.policy_versions}


@pytest.fixture
def receiver(capture_address):
    from vllm_specrl.capture.receiver import CaptureReceiver

    receiver = CaptureReceiver(capture_address)
    yield receiver
    receiver.close()


def status(server) -> dict:
    return requests.get(server.url + "/specrl/status", timeout=60).json()


def test_native_routes_keep_versions_guard_and_capture_and_refuse_a_bad_draft(server, tiny_model, draft,
                                                                              receiver, tmp_path):
    before, r = complete(server)
    assert r.headers["x-specrl-policy-version"] == "0"
    moved = perturbed_checkpoint(tiny_model, tmp_path / "moved", seed=5)

    r = native_update(server, load_file(moved / "model.safetensors"), weight_version="7")
    assert r.status_code == 200, r.text
    after, r = complete(server)
    assert after != before
    assert (r.headers["x-specrl-policy-version-start"], r.headers["x-specrl-policy-version"]) == ("7", "7")
    s = status(server)
    assert s["versions"] == {"policy": 7, "draft": 0}
    assert s["stale_draft"]["version_lag"] == 7 and s["stale_draft"]["stale"], s["stale_draft"]
    assert requests.get(server.url + "/weight_info", timeout=30).json()["weight_version"] == "7"
    drain(receiver)  # the frames of the completions so far
    complete(server)
    assert drain(receiver, wanted=len(PROMPTS)) == {7}

    weights = load_file(draft / "model.safetensors")
    bad = dict(weights, d2t=weights["d2t"].clone())
    bad["d2t"][0] = 10 ** 6
    r = native_update(server, bad, draft=True)
    assert r.status_code >= 400 and "d2t" in r.text and "outside the target vocabulary" in r.text, r.text
    for _ in range(2):  # every completion after the refusal answers, from the same weights
        tokens, r = complete(server)
        assert tokens == after
    assert status(server)["versions"] == {"policy": 7, "draft": 0}

    r = native_update(server, weights, draft=True)
    assert r.status_code == 200, r.text
    assert status(server)["versions"] == {"policy": 7, "draft": 1}  # counted
    r = post(server, "/update_weight_version", new_version="7")  # the trainer names it: trained for policy 7
    assert r.status_code == 200, r.text
    s = status(server)
    assert s["versions"] == {"policy": 7, "draft": 7}
    # no lag left (a random draft may still be flagged for accepting nothing: the guard's other signal)
    assert s["stale_draft"]["version_lag"] == 0, s["stale_draft"]
    assert not [reason for reason in s["stale_draft"]["reasons"] if "lags" in reason], s["stale_draft"]
    assert complete(server)[0] == after  # a draft never changes what is sampled


def test_an_engine_group_sends_through_specrl_shm_whole_or_not_at_all(server, tiny_model, tmp_path):
    """``FleetClient.native().send_shm``: every chunk staged and validated before anything applies, so a
    bad later chunk leaves the earlier ones unapplied too; a good update lands with its label."""
    from vllm_specrl.sync.clients.engine_group import EngineGroupError
    from vllm_specrl.sync.clients.fleet import FleetClient

    group = FleetClient([server.url]).native()
    before, _ = complete(server)
    version = status(server)["versions"]["policy"]
    moved = load_file(perturbed_checkpoint(tiny_model, tmp_path / "moved", seed=21) / "model.safetensors")
    items = sorted(moved.items())
    bad = dict(items[:5] + [(items[5][0], items[5][1][:-1])] + items[6:])  # one tensor a row short
    with pytest.raises(EngineGroupError) as err:
        group.send_shm(bad, weight_version=str(version + 5), chunk_bytes=1)  # one tensor per chunk
    assert "shape" in str(err.value.engines[0]), err.value.engines
    assert complete(server)[0] == before and status(server)["versions"]["policy"] == version
    group.send_shm(moved, weight_version=str(version + 5))
    after, r = complete(server)
    assert after != before and r.headers["x-specrl-policy-version"] == str(version + 5)
