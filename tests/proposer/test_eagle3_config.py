import pytest

from vllm_specrl.proposer.eagle3_config import (
    SPECRL_ARCH,
    DraftConfigError,
    check_fits_target,
    default_aux_layer_ids,
    draft_config_from_target,
)

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 30, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 1000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


@pytest.mark.parametrize("layers,expected", [(30, (2, 15, 27)), (32, (2, 16, 29)), (8, (2, 4, 5)),
                                             (6, (1, 3, 5)), (4, (1, 2, 3)), (3, (0, 1, 2))])
def test_default_aux_layers_are_distinct(layers, expected):
    assert default_aux_layer_ids(layers) == expected


def test_draft_config_from_llama_and_qwen():
    cfg = draft_config_from_target(LLAMA, draft_vocab_size=256)
    assert cfg["architectures"] == [SPECRL_ARCH] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["draft_vocab_size"] == 256 and cfg["vocab_size"] == 1000
    assert cfg["head_dim"] == 16 and cfg["target_hidden_size"] == 64
    qwen = draft_config_from_target(dict(LLAMA, architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert qwen["head_dim"] == 32 and qwen["specrl"]["target_architecture"] == "Qwen3ForCausalLM"
    with pytest.raises(DraftConfigError, match="GPT2LMHeadModel not supported"):
        draft_config_from_target(dict(LLAMA, architectures=["GPT2LMHeadModel"]))


def test_fitting_draft_passes():
    check_fits_target(draft_config_from_target(LLAMA), 64, 1000, 30)


def test_misfit_draft_names_every_mismatch():
    cfg = draft_config_from_target(LLAMA)
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 2, 40]
    with pytest.raises(DraftConfigError) as err:
        check_fits_target(cfg, 128, 999, 30)
    msg = str(err.value)
    assert "target hidden size 64, target has 128" in msg
    assert "draft vocab size 1000 != target vocab size 999" in msg
    assert "[40] outside the target's 0..30" in msg and "repeat a layer" in msg


@pytest.mark.parametrize("key,value", [("norm_before_residual", True), ("fc_norm", True), ("norm_output", True),
                                       ("norm_before_fc", True), ("logit_scale", 2.0), ("attention_bias", True)])
def test_flags_vllm_reads_but_the_trainer_does_not_implement_are_refused_by_name(key, value):
    from vllm_specrl.proposer.eagle3_config import DraftShape

    cfg = draft_config_from_target(LLAMA)
    cfg[key] = value
    with pytest.raises(DraftConfigError, match=key):
        DraftShape.from_config(cfg)
    with pytest.raises(DraftConfigError, match=key):
        check_fits_target(cfg, 64, 1000, 30)


def test_rope_scaling_and_unsorted_aux_layers_are_refused():
    from vllm_specrl.proposer.eagle3_config import DraftShape

    cfg = draft_config_from_target(LLAMA)
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    with pytest.raises(DraftConfigError, match="rope scaling"):
        DraftShape.from_config(cfg)
    cfg = draft_config_from_target(LLAMA, aux_layer_ids=(15, 2, 27))
    with pytest.raises(DraftConfigError, match="must be increasing"):
        DraftShape.from_config(cfg)
