"""``all_finite``: the fast NaN/Inf check staging runs on every tensor of an update."""

import pytest
import torch

from vllm_specrl.sync.worker.validate import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_finds_every_nan_and_inf(dtype):
    t = torch.randn(64, 33).to(dtype)
    assert all_finite(t)
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[17, 5] = bad
        assert not all_finite(u), (dtype, bad)


def test_finite_values_whose_sum_overflows_are_finite():
    big = torch.full((8,), 3.0e38, dtype=torch.bfloat16)
    assert not torch.isfinite(big.sum(dtype=torch.float32))  # the fast path cannot decide ...
    assert all_finite(big)  # ... so the exact check does


def draft_specs(draft_vocab: int = 6, target_vocab: int = 10) -> dict:
    from vllm_specrl.sync.worker.validate import ParamSpec

    return {"d2t": ParamSpec((draft_vocab,), torch.int64), "t2d": ParamSpec((target_vocab,), torch.bool),
            "lm_head.weight": ParamSpec((draft_vocab, 4), torch.float32)}


def test_index_maps_in_range_pass():
    from vllm_specrl.sync.worker.validate import tensor_problems

    target_ids = torch.tensor([0, 2, 3, 5, 8, 9])
    d2t = target_ids - torch.arange(6)
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[target_ids] = True
    assert tensor_problems("d2t", d2t, draft_specs()) == []
    assert tensor_problems("t2d", t2d, draft_specs()) == []


@pytest.mark.parametrize("target_ids,match", [
    ([0, 2, 3, 5, 8, 10], "outside the target vocabulary"),   # one past the end: vLLM would index out of bounds
    ([-1, 2, 3, 5, 8, 9], "outside the target vocabulary"),
    ([0, 2, 2, 5, 8, 9], "already maps to"),
])
def test_out_of_range_or_colliding_d2t_is_refused(target_ids, match):
    from vllm_specrl.sync.worker.validate import tensor_problems

    d2t = torch.tensor(target_ids) - torch.arange(6)
    problems = tensor_problems("d2t", d2t, draft_specs())
    assert len(problems) == 1 and match in problems[0] and problems[0].startswith("d2t:"), problems


def test_t2d_marking_the_wrong_number_of_tokens_is_refused():
    from vllm_specrl.sync.worker.validate import tensor_problems

    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[:5] = True
    assert "marks 5 target tokens" in tensor_problems("t2d", t2d, draft_specs())[0]


def hub_cache(root, repo: str, files: dict[str, dict[str, torch.Tensor]]):
    """A Hugging Face cache holding ``repo`` as ``vllm serve <repo>`` leaves it (refs/main -> a snapshot)."""
    import json

    from safetensors.torch import save_file

    base = root / f"models--{repo.replace('/', '--')}"
    snapshot = base / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("a" * 40)
    for name, tensors in files.items():
        save_file(tensors, snapshot / name)
    (snapshot / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    return snapshot


def test_a_hub_id_resolves_to_the_cached_snapshot_with_every_shard(tmp_path, monkeypatch):
    """A policy served by hub id, sharded as large checkpoints are: its specs and tensors are read from
    the cache vLLM downloaded into (planted: the directory taken as given -> FileNotFoundError)."""
    from vllm_specrl.sync.worker.validate import checkpoint_specs, load_checkpoint, local_checkpoint_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shards = {"model-00001-of-00002.safetensors": {"a.weight": torch.ones(2, 3)},
              "model-00002-of-00002.safetensors": {"b.weight": torch.zeros(4, dtype=torch.bfloat16)}}
    snapshot = hub_cache(tmp_path / "cache", "org/policy", shards)
    assert local_checkpoint_dir("org/policy", download_dir=str(tmp_path / "cache")) == snapshot
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))  # the default cache
    specs = checkpoint_specs("org/policy")
    assert {n: (s.shape, s.dtype) for n, s in specs.items()} == {
        "a.weight": ((2, 3), torch.float32), "b.weight": ((4,), torch.bfloat16)}
    assert sorted(load_checkpoint("org/policy")) == ["a.weight", "b.weight"]


def test_a_model_neither_local_nor_cached_is_named(tmp_path, monkeypatch):
    from vllm_specrl.sync.worker.validate import local_checkpoint_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="neither a directory nor a model in the Hugging Face cache"):
        local_checkpoint_dir("org/absent", download_dir=str(tmp_path))
