"""EAGLE-3 draft checkpoints: init from a target, save, load, export, import.

A checkpoint is an HF directory: ``config.json`` (see ``eagle3_config``) and
``model.safetensors`` in the stock EAGLE-3 weight layout, so stock vLLM
``eagle3``, speculators and EAGLE tooling read it and we read theirs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_specrl.proposer.eagle3_config import (
    KNOWN_ARCHS,
    SPECRL_ARCH,
    STOCK_ARCH,
    DraftConfigError,
    draft_config_from_target,
    read_config,
)
from vllm_specrl.proposer.eagle3_torch import Eagle3Draft

WEIGHTS = "model.safetensors"
INIT_STD = 0.02  # fresh fc/midlayer matrices, as in Llama's initializer_range


def _target_tensor(target_dir: Path, names: tuple[str, ...]) -> torch.Tensor | None:
    """First of ``names`` found in the target's safetensors shards."""
    for shard in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(shard, "pt") as fh:
            for name in names:
                if name in fh.keys():
                    return fh.get_tensor(name)
    return None


def target_embedding(target_dir: Path) -> torch.Tensor:
    emb = _target_tensor(target_dir, ("model.embed_tokens.weight", "embed_tokens.weight"))
    if emb is None:
        raise DraftConfigError(f"no embed_tokens weight in {target_dir}")
    return emb


def target_lm_head(target_dir: Path) -> torch.Tensor:
    """The target's LM head (its embedding when the two are tied)."""
    head = _target_tensor(target_dir, ("lm_head.weight",))
    return head if head is not None else target_embedding(target_dir)


def target_final_norm(target_dir: Path) -> torch.Tensor:
    """The target's final RMSNorm weight (what its logits apply to the last hidden state)."""
    norm = _target_tensor(target_dir, ("model.norm.weight", "norm.weight"))
    if norm is None:
        raise DraftConfigError(f"no final norm weight in {target_dir}")
    return norm


def init_draft(target_dir: Path | str, out_dir: Path | str | None = None,
               draft_vocab_size: int | None = None, aux_layer_ids: tuple[int, ...] | None = None,
               token_counts: torch.Tensor | None = None, seed: int = 0,
               target_layer: int | None = None) -> Eagle3Draft:
    """A fresh draft for ``target_dir``: embedding and LM-head rows from the target.

    With ``draft_vocab_size`` below the target's, the draft vocabulary is the
    most frequent tokens by ``token_counts`` (or the lowest ids, which a BPE
    assigns to the most frequent merges, when no counts are given). With
    ``target_layer`` (an index into the target's layers, -1 the last), the
    decoder layer starts from that target layer (``start_from_target_layer``)
    instead of at random.
    """
    target_dir = Path(target_dir)
    config = draft_config_from_target(read_config(target_dir), draft_vocab_size, aux_layer_ids)
    torch.manual_seed(seed)
    draft = Eagle3Draft(config)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0.0, INIT_STD)
        draft.embed_tokens.weight.copy_(target_embedding(target_dir).float())
        head = target_lm_head(target_dir).float()
        if draft.d2t is not None:
            vocab = config["vocab_size"]
            scores = token_counts.float() if token_counts is not None else -torch.arange(vocab).float()
            ids = scores.topk(config["draft_vocab_size"]).indices
            draft.set_draft_vocab(ids)
        draft.lm_head.weight.copy_(head[draft.draft_token_ids()])
    if target_layer is not None:
        start_from_target_layer(draft, target_dir, target_layer)
    if out_dir is not None:
        save_draft(draft, out_dir)
    return draft


class TargetLayerMissing(DraftConfigError):
    """The target's checkpoint does not hold a decoder layer under the Llama names the draft copies."""


def start_from_target_layer(draft: Eagle3Draft, target_dir: Path | str, layer: int = -1) -> None:
    """Start the draft's decoder layer from one of the target's layers rather than at random.

    The draft's layer has the target layer's shapes but reads [embedding; fc(aux states)] and
    predicts one token further ahead, so this is a starting point, not an equivalence: the MLP,
    the output projection and the norms are the target layer's, the query/key/value columns that
    read ``fc``'s half are the target layer's (those reading the embedding half stay random),
    ``fc`` starts by passing the highest aux state through, and the final norm is the target's.
    A warm start from there reaches a given held-out acceptance in fewer steps than from random
    weights (benchmarks/JOURNAL.md, "Drafts that start from the target's last layer").
    """
    target_dir = Path(target_dir)
    num_layers = read_config(target_dir)["num_hidden_layers"]
    index = layer + num_layers if layer < 0 else layer
    if not 0 <= index < num_layers:
        raise DraftConfigError(f"target layer {layer} out of range: the target has {num_layers} layers")
    prefix = f"model.layers.{index}."
    names = [f"self_attn.{n}_proj.weight" for n in "qkvo"] + [f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    names += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    found = {n: _target_tensor(target_dir, (prefix + n,)) for n in names}
    missing = [n for n, t in found.items() if t is None]
    if missing:
        raise TargetLayerMissing(f"target layer {index} has no {', '.join(missing)} in {target_dir}")
    final_norm = target_final_norm(target_dir)  # read before any copy: a refusal leaves the draft as it was
    layer_mod, width = draft.midlayer, draft.shape.hidden_size
    attn, mlp = layer_mod.self_attn, layer_mod.mlp
    with torch.no_grad():
        for proj in ("q", "k", "v"):
            getattr(attn, f"{proj}_proj").weight[:, width:].copy_(found[f"self_attn.{proj}_proj.weight"])
        attn.o_proj.weight.copy_(found["self_attn.o_proj.weight"])
        for proj in ("gate", "up", "down"):
            getattr(mlp, f"{proj}_proj").weight.copy_(found[f"mlp.{proj}_proj.weight"])
        layer_mod.hidden_norm.weight.copy_(found["input_layernorm.weight"])
        layer_mod.post_attention_layernorm.weight.copy_(found["post_attention_layernorm.weight"])
        draft.norm.weight.copy_(final_norm)
        if draft.shape.target_hidden_size == width:
            aux = list(draft.shape.aux_layer_ids)
            highest = aux.index(max(aux))
            draft.fc.weight.zero_()
            draft.fc.weight[:, highest * width:(highest + 1) * width].copy_(torch.eye(width))


def save_draft(draft: Eagle3Draft, out_dir: Path | str, architecture: str = SPECRL_ARCH,
               dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors (atomically replacing ``out_dir``)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = dict(draft.config, architectures=[architecture])
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    tensors = {}
    for name, tensor in draft.checkpoint_state_dict().items():
        t = tensor.detach().cpu().contiguous()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t
    save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return out_dir


def load_draft(draft_dir: Path | str, target_dir: Path | str | None = None) -> Eagle3Draft:
    """Load a draft (ours, stock vLLM, speculators or EAGLE layout).

    The embedding comes from the checkpoint if it has one, else from ``target_dir``.
    """
    draft_dir = Path(draft_dir)
    config = read_config(draft_dir)
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in KNOWN_ARCHS:
        raise DraftConfigError(f"{draft_dir}: architecture {arch} is not an EAGLE-3 draft ({KNOWN_ARCHS})")
    draft = Eagle3Draft(config)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(draft_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as fh:
            for name in fh.keys():
                state[name.removeprefix("model.")] = fh.get_tensor(name)
    if "embed_tokens.weight" not in state:
        if target_dir is None:
            raise DraftConfigError(f"{draft_dir} has no embedding; pass the target directory")
        state["embed_tokens.weight"] = target_embedding(Path(target_dir))
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise DraftConfigError(f"{draft_dir}: weights do not match the config: "
                               f"missing={missing} unexpected={unexpected}")
    return draft


def convert_draft(src: Path | str, out_dir: Path | str, architecture: str,
                  target_dir: Path | str | None = None) -> Path:
    """Rewrite a draft for another loader: STOCK_ARCH for plain vLLM, SPECRL_ARCH for ours."""
    draft = load_draft(src, target_dir)
    return save_draft(draft, out_dir, architecture=architecture)


def export_stock(src: Path | str, out_dir: Path | str, target_dir: Path | str | None = None) -> Path:
    """A copy that plain vLLM ``eagle3`` loads without vllm-specrl."""
    return convert_draft(src, out_dir, STOCK_ARCH, target_dir)
