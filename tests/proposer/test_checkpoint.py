import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_specrl.proposer.checkpoint import (
    export_stock,
    init_draft,
    load_draft,
    target_embedding,
    target_lm_head,
)
from vllm_specrl.proposer.eagle3_config import SPECRL_ARCH, STOCK_ARCH, DraftConfigError


def test_init_draft_takes_embedding_and_head_from_the_target(tiny_model, tmp_path):
    d = init_draft(tiny_model, tmp_path / "d", seed=0)
    torch.testing.assert_close(d.embed_tokens.weight, target_embedding(tiny_model).float())
    torch.testing.assert_close(d.lm_head.weight, target_lm_head(tiny_model).float())
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == [SPECRL_ARCH]
    names = set(load_file(tmp_path / "d" / "model.safetensors"))
    assert "embed_tokens.weight" not in names, "the embedding is shared with the target, not saved"
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight"} <= names


def test_reduced_vocab_follows_token_counts(tiny_model, tmp_path):
    counts = torch.zeros(4096)
    counts[[7, 300, 4000, 12]] = torch.tensor([5.0, 50.0, 20.0, 1.0])
    d = init_draft(tiny_model, tmp_path / "d", draft_vocab_size=512, token_counts=counts)
    ids = d.draft_token_ids()
    assert {7, 300, 4000, 12} <= set(ids.tolist()) and len(set(ids.tolist())) == 512
    torch.testing.assert_close(d.lm_head.weight, target_lm_head(tiny_model).float()[ids])
    saved = load_file(tmp_path / "d" / "model.safetensors")
    assert saved["d2t"].shape == (512,) and saved["t2d"].sum() == 512


def test_save_load_roundtrip_and_stock_export(tiny_model, tmp_path):
    d = init_draft(tiny_model, tmp_path / "d", draft_vocab_size=256, seed=3)
    back = load_draft(tmp_path / "d", tiny_model)
    for (n, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)
    stock = export_stock(tmp_path / "d", tmp_path / "stock", tiny_model)
    assert json.loads((stock / "config.json").read_text())["architectures"] == [STOCK_ARCH]
    assert load_file(stock / "model.safetensors").keys() == load_file(tmp_path / "d" / "model.safetensors").keys()


def test_imports_a_draft_with_model_prefix_and_own_embedding(tiny_model, tmp_path):
    d = init_draft(tiny_model, tmp_path / "d", seed=0)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["architectures"] = ["Eagle3LlamaForCausalLM"]
    (foreign / "config.json").write_text(json.dumps(cfg))
    state = {("model." + k if not k.startswith("lm_head") else k): v.contiguous()
             for k, v in d.state_dict().items()}
    save_file(state, foreign / "model.safetensors")
    back = load_draft(foreign)  # embedding in the checkpoint: no target needed
    torch.testing.assert_close(back.fc.weight, d.fc.weight)


def test_not_a_draft_is_rejected(tiny_model):
    with pytest.raises(DraftConfigError, match="LlamaForCausalLM is not an EAGLE-3 draft"):
        load_draft(tiny_model)
