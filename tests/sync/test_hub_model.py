"""A policy served as a first GPU user serves one: by hub id (``vllm serve org/model``, from the Hugging
Face cache) and sharded (``model-0000N-of-0000M.safetensors`` with an index), and updated in place: the
worker finds the checkpoint's tensor specs in the cached snapshot, across every shard (it used to look for
``*.safetensors`` in a directory named ``org/model`` and refuse every update), and ``load_checkpoint``
reads the update back from the hub id as ``selftest --model`` does.

Engines: one `vllm serve` of the tiny target by hub id, offline, from a cache built here: the only layout
that resolves a model through the hub cache.
"""

from __future__ import annotations

import json
import shutil

import pytest
import requests
from safetensors.torch import load_file, save_file

from vllm_specrl.launcher import VLLMServer, cpu_env
from vllm_specrl.sync.clients.engine_client import EngineClient

pytestmark = pytest.mark.server
REPO = "specrl-test/tiny-sharded"


@pytest.fixture(scope="module")
def cache(tiny_model, tmp_path_factory):
    """The tiny target resharded in two and laid out as the Hugging Face cache holds a download."""
    root = tmp_path_factory.mktemp("hf_cache")
    base = root / f"models--{REPO.replace('/', '--')}"
    snapshot = base / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("0" * 40)
    for path in tiny_model.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, snapshot / path.name)
    tensors = load_file(tiny_model / "model.safetensors")
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, 1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, snapshot / shard)
        weight_map.update({n: shard for n in part})
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.fixture(scope="module")
def server(cache, tmp_path_factory):
    env = dict(cpu_env(), HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    log = tmp_path_factory.mktemp("hub") / "serve.log"
    with VLLMServer(REPO, ["--dtype", "float32", "--max-model-len", "256"], env=env, log_path=log) as srv:
        yield srv


def greedy(server) -> str:
    r = requests.post(server.url + "/v1/completions", headers=server.headers, timeout=300, json={
        "model": server.model, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def test_an_update_to_a_model_served_by_hub_id_commits(server, cache, monkeypatch, tiny_model):
    import huggingface_hub.constants

    from vllm_specrl.sync.worker.validate import load_checkpoint

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    weights = load_checkpoint(REPO)  # every shard, from the cache, as selftest --model reads it
    assert weights.keys() == load_file(tiny_model / "model.safetensors").keys()
    before = greedy(server)
    client = EngineClient(server.url, progress=False)
    zeroed = dict(weights, **{n: t * 0 for n, t in weights.items() if n.endswith("mlp.down_proj.weight")})
    assert client.update_policy(zeroed, version=1)["ok"]
    assert greedy(server) != before  # the update served
    assert client.update_policy(weights, version=2)["ok"]
    assert greedy(server) == before
    assert client.status()["versions"]["policy"] == 2
