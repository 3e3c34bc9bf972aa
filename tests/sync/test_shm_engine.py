"""vLLM's native four-phase weight-transfer API on CPU through the ``specrl_shm`` backend.

Engines: one in-process engine (``in_engine_process``) that takes the native update and one fresh engine on
the new weights per case: exactness is judged against a fresh engine.
"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import in_engine_process
from sampling import greedy_generate

PROMPTS = ["def f(x):", "import os\n", "class A:", "    return self."]


@pytest.fixture(scope="module")
def shifted(tiny_model, tmp_path_factory):
    """Tiny weights with a perturbed (tied) embedding: the case vLLM's CPU reload got wrong."""
    out = tmp_path_factory.mktemp("shifted") / "model"
    shutil.copytree(tiny_model, out)
    w = load_file(tiny_model / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    w = {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v for k, v in w.items()}
    save_file(w, out / "model.safetensors")
    return out


@in_engine_process(env={"VLLM_PLUGINS": "specrl"})
def native_update(model: Path, new_weights: Path, corrupt: bool = False) -> list[list[int]]:
    """vLLM's four phases through ``specrl_shm`` (two shared-memory chunks; ``corrupt``: one tensor a row
    short), then greedy tokens of ``PROMPTS``."""
    from vllm import LLM, SamplingParams

    from vllm_specrl.sync.shm import write_chunk

    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512,
              weight_transfer_config={"backend": "specrl_shm"})
    items = list(load_file(str(new_weights / "model.safetensors")).items())
    if corrupt:
        items[3] = (items[3][0], items[3][1][:-1])
    paths = [write_chunk(dict(items[:10])), write_chunk(dict(items[10:]))]
    llm.init_weight_transfer_engine({"init_info": {}})
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"paths": [str(p) for p in paths]}})
    finally:
        for path in paths:
            path.unlink()
    llm.finish_weight_update(weight_version="v1")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_native_update_equals_a_fresh_engine(tiny_model, shifted):
    expected = greedy_generate(shifted, PROMPTS, 16)["tokens"]
    assert expected != greedy_generate(tiny_model, PROMPTS, 16)["tokens"]
    assert native_update(tiny_model, shifted) == expected


def test_native_update_rejects_a_bad_chunk_by_name(tiny_model, shifted):
    with pytest.raises(AssertionError, match=r"(?s)rejected.*: shape \["):
        native_update(tiny_model, shifted, corrupt=True)
