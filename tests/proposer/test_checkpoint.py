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


def test_a_draft_started_from_a_target_layer_computes_that_layer(tiny_model):
    """Against the target's own HF layer: every part copied computes what the target's does."""
    from transformers import AutoModelForCausalLM

    from vllm_specrl.proposer.checkpoint import start_from_target_layer

    target = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    layers = target.model.layers
    d = init_draft(tiny_model, None, seed=0, target_layer=-1)
    width = d.shape.hidden_size
    h = torch.randn(2, 5, width)
    mid, source = d.midlayer, layers[len(layers) - 1]
    with torch.no_grad():
        torch.testing.assert_close(mid.mlp(h), source.mlp(h))
        torch.testing.assert_close(mid.self_attn.o_proj(h), source.self_attn.o_proj(h))
        for proj in ("q_proj", "k_proj", "v_proj"):
            # The columns reading fc's half are the target's; those reading the embedding are not.
            fc_half = torch.cat([torch.zeros_like(h), h], dim=-1)
            torch.testing.assert_close(getattr(mid.self_attn, proj)(fc_half), getattr(source.self_attn, proj)(h))
        torch.testing.assert_close(mid.hidden_norm(h), source.input_layernorm(h))
        torch.testing.assert_close(mid.post_attention_layernorm(h), source.post_attention_layernorm(h))
        torch.testing.assert_close(d.norm(h), target.model.norm(h))
        aux_ids = list(d.shape.aux_layer_ids)
        aux = torch.randn(2, 5, len(aux_ids) * width)
        top = aux_ids.index(max(aux_ids))
        torch.testing.assert_close(d.fc(aux), aux[..., top * width:(top + 1) * width])
        # An index picks that layer; the default (no target_layer) stays random.
        start_from_target_layer(d, tiny_model, 0)
        torch.testing.assert_close(mid.mlp(h), layers[0].mlp(h))
        fresh = init_draft(tiny_model, None, seed=0)
        assert not torch.allclose(fresh.midlayer.mlp(h), source.mlp(h))
    with pytest.raises(DraftConfigError, match="out of range"):
        start_from_target_layer(d, tiny_model, len(layers))


def test_a_target_without_that_layer_under_llama_names_is_named(tiny_model, tmp_path):
    """What the warm start falls back to random weights on: the missing tensors are named."""
    import shutil

    from vllm_specrl.proposer.checkpoint import TargetLayerMissing, start_from_target_layer

    odd = tmp_path / "odd"
    shutil.copytree(tiny_model, odd)
    weights = load_file(odd / "model.safetensors")
    save_file({k.replace("mlp.up_proj", "mlp.w3"): v.contiguous() for k, v in weights.items()},
              odd / "model.safetensors")
    d = init_draft(tiny_model, None, seed=0)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    with pytest.raises(TargetLayerMissing, match="mlp.up_proj.weight"):
        start_from_target_layer(d, odd, -1)
    for name, tensor in d.state_dict().items():  # the warm start goes on with this draft, as it was
        torch.testing.assert_close(tensor, before[name], msg=name)
