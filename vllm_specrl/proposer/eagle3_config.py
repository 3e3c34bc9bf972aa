"""EAGLE-3 draft checkpoint config: one definition for training, vLLM and export.

A draft is an HF-format directory (``config.json`` + ``model.safetensors``) in
the layout vLLM's ``eagle3`` method and speculators/EAGLE use: a Llama config
with one decoder layer, ``draft_vocab_size``, ``target_hidden_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``. Weights: ``fc``,
``midlayer.*``, ``norm``, ``lm_head`` (draft vocabulary) and, with a reduced
vocabulary, ``d2t``/``t2d``; the embedding is the target's (shared by vLLM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Our architecture (registered by the general plugin) and the stock one that
# plain vLLM, speculators and EAGLE checkpoints use. vLLM's EAGLEConfig keeps
# names ending in "Eagle3", so both route to an Eagle3 class.
SPECRL_ARCH = "SpecRLLlamaForCausalLMEagle3"
STOCK_ARCH = "LlamaForCausalLMEagle3"
KNOWN_ARCHS = (SPECRL_ARCH, STOCK_ARCH, "Eagle3LlamaForCausalLM")
TARGET_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


class DraftConfigError(ValueError):
    """A draft checkpoint does not fit its target, or is not an EAGLE-3 draft."""


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's (2, L//2, L-3), made distinct for shallow targets (L < 8)."""
    ids = (2, num_target_layers // 2, num_target_layers - 3)
    if len(set(ids)) == 3 and all(0 < i < num_target_layers for i in ids):
        return ids
    if num_target_layers < 3:
        raise DraftConfigError(f"an EAGLE-3 draft needs a target with >= 3 layers, got {num_target_layers}")
    # Spread over the stack: early, middle, late (residual stream entering each layer).
    return (1, max(2, num_target_layers // 2), num_target_layers - 1) if num_target_layers > 3 else (0, 1, 2)


@dataclass(frozen=True)
class DraftShape:
    """What a draft must agree on with its target."""

    hidden_size: int
    target_hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any], check_flags: bool = True) -> DraftShape:
        eagle = cfg.get("eagle_config") or {}
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            raise DraftConfigError("draft config has no eagle_aux_hidden_state_layer_ids")
        if check_flags and unsupported_flags(cfg):
            raise DraftConfigError("EAGLE-3 draft uses settings vllm-specrl does not train or serve "
                                   "identically: " + "; ".join(unsupported_flags(cfg)))
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        return cls(
            hidden_size=cfg["hidden_size"],
            target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            aux_layer_ids=tuple(int(i) for i in ids),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        )


# Flags vLLM's Eagle3LlamaForCausalLM (0.32) reads that change the draft's math, with the value the
# torch module (and so training) implements. A draft that sets another value is refused by name:
# serving it while training something else would put the estimate and the served acceptance apart.
SUPPORTED_FLAG_VALUES: dict[str, Any] = {
    "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
    "attention_bias": False, "mlp_bias": False, "logit_scale": 1.0, "num_hidden_layers": 1,
    "hidden_act": "silu",
}


def unsupported_flags(cfg: dict[str, Any]) -> list[str]:
    """Every EAGLE-3 setting whose value the trainer does not implement, by name."""
    eagle = cfg.get("eagle_config") or {}
    problems = []
    for key, want in SUPPORTED_FLAG_VALUES.items():
        value = eagle.get(key, cfg.get(key, want))
        if value is not None and value != want:
            problems.append(f"{key}={value!r} (supported: {want!r})")
    if eagle.get("use_aux_hidden_state", True) is False:
        problems.append("use_aux_hidden_state=False (supported: True)")
    rope = cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default" or cfg.get("rope_scaling"):
        problems.append(f"rope scaling {cfg.get('rope_scaling') or rope} (supported: plain RoPE)")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids") or []
    if list(ids) != sorted(set(ids)):
        # vLLM sorts and de-duplicates the layer ids, then concatenates in that order.
        problems.append(f"eagle_aux_hidden_state_layer_ids {list(ids)} must be increasing (vLLM sorts them)")
    return problems


def read_config(directory: Path | str) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise DraftConfigError(f"{directory} has no config.json")
    return json.loads(path.read_text())


def draft_config_from_target(target_cfg: dict[str, Any], draft_vocab_size: int | None = None,
                             aux_layer_ids: tuple[int, ...] | None = None,
                             architecture: str = SPECRL_ARCH) -> dict[str, Any]:
    """The draft's config.json for a Llama/Qwen2/Qwen3-architecture target."""
    arch = (target_cfg.get("architectures") or ["?"])[0]
    if arch not in TARGET_ARCHS:
        raise DraftConfigError(f"target architecture {arch} not supported; expected one of {TARGET_ARCHS}")
    layers = target_cfg["num_hidden_layers"]
    ids = tuple(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(layers)
    vocab = target_cfg["vocab_size"]
    heads = target_cfg["num_attention_heads"]
    rope = dict(target_cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", target_cfg.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", "default")
    cfg = {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": target_cfg["hidden_size"],
        "target_hidden_size": target_cfg["hidden_size"],
        "intermediate_size": target_cfg["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": target_cfg.get("num_key_value_heads") or heads,
        "head_dim": target_cfg.get("head_dim") or target_cfg["hidden_size"] // heads,
        "hidden_act": "silu",
        "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-6),
        "rope_parameters": rope,
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 2048),
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab_size or vocab,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": target_cfg.get("dtype") or target_cfg.get("torch_dtype") or "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True},
        "specrl": {"target_architecture": arch, "target_num_hidden_layers": layers},
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in target_cfg:
            cfg[key] = target_cfg[key]
    return cfg


def default_mask_token_id(target_cfg: dict[str, Any]) -> int:
    """The token a parallel draft's mask slots read: the target's padding token (else end of text).

    Its embedding is the target's and stays frozen; what the slots learn is ``mask_hidden``."""
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = target_cfg.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def check_fits_target(draft_cfg: dict[str, Any], target_hidden_size: int, target_vocab_size: int,
                      target_num_layers: int) -> None:
    """Raise DraftConfigError naming every way the draft does not fit the target."""
    shape = DraftShape.from_config(draft_cfg, check_flags=False)
    problems = unsupported_flags(draft_cfg)
    if shape.target_hidden_size != target_hidden_size:
        problems.append(f"draft expects target hidden size {shape.target_hidden_size}, "
                        f"target has {target_hidden_size}")
    if shape.hidden_size != target_hidden_size and "target_hidden_size" not in draft_cfg:
        problems.append(f"draft hidden size {shape.hidden_size} != target hidden size {target_hidden_size}")
    if shape.vocab_size != target_vocab_size:
        problems.append(f"draft vocab size {shape.vocab_size} != target vocab size {target_vocab_size}")
    if shape.draft_vocab_size > shape.vocab_size:
        problems.append(f"draft_vocab_size {shape.draft_vocab_size} > vocab size {shape.vocab_size}")
    bad = [i for i in shape.aux_layer_ids if not 0 <= i <= target_num_layers]
    if bad:
        problems.append(f"aux hidden state layers {bad} outside the target's 0..{target_num_layers}")
    if len(set(shape.aux_layer_ids)) != len(shape.aux_layer_ids):
        problems.append(f"aux hidden state layers {list(shape.aux_layer_ids)} repeat a layer")
    if problems:
        raise DraftConfigError("EAGLE-3 draft does not fit the target model: " + "; ".join(problems))


EAGLE3_CLASS_PATH = "vllm_specrl.proposer.eagle3_vllm:SpecRLEagle3LlamaForCausalLM"


def register_eagle3_architecture() -> str:
    """Register the draft architecture with vLLM's ``ModelRegistry`` (a public API; lazy by path, so
    nothing of the model is imported here)."""
    from vllm import ModelRegistry

    if SPECRL_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(SPECRL_ARCH, EAGLE3_CLASS_PATH)
    return SPECRL_ARCH
