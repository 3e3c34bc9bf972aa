"""What a weight update may contain, checked before the first byte reaches the model.

The accepted names, shapes and dtypes are those of the checkpoint vLLM loaded
(HF names, as ``transformers``' ``named_parameters()`` gives them), read from
the safetensors headers without loading the tensors. Floating tensors may
arrive in any of the floating dtypes below (vLLM casts while loading);
everything else (``d2t``/``t2d`` index maps) must match exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from vllm_specrl.compat.engine_config import local_checkpoint_dir

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
TIED_HEAD = "lm_head.weight"


class WeightUpdateError(ValueError):
    """An update that must be refused; ``problems`` names each offending tensor."""

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = problems or []
        detail = "; ".join(self.problems[:20]) + (" ..." if len(self.problems) > 20 else "")
        super().__init__(f"{message}: {detail}" if detail else message)


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    optional: bool = False  # checked when sent, never required (weights this engine does not serve)


def load_checkpoint(model: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (a directory or a cached hub id), all its shards."""
    from safetensors.torch import load_file

    files = sorted(local_checkpoint_dir(model).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(load_file(path))
    return tensors


def checkpoint_specs(model_dir: Path | str) -> dict[str, ParamSpec]:
    """Name -> shape/dtype of every tensor in an HF checkpoint (headers only; every shard)."""
    model_dir = local_checkpoint_dir(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    specs: dict[str, ParamSpec] = {}
    for path in files:
        with safe_open(path, "pt") as fh:  # reads the header; tensors stay on disk
            for name in fh.keys():
                piece = fh.get_slice(name)
                specs[name] = ParamSpec(tuple(piece.get_shape()), SAFETENSORS_DTYPES[piece.get_dtype()])
    config = model_dir / "config.json"
    if config.exists() and json.loads(config.read_text()).get("tie_word_embeddings") \
            and TIED_HEAD not in specs and "model.embed_tokens.weight" in specs:
        # transformers' state_dict() lists the tied head; vLLM ignores it. Accept it.
        specs[TIED_HEAD] = specs["model.embed_tokens.weight"]
    return specs


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN/Inf in ``tensor``, at the cost of one float32 reduction.

    Any NaN or Inf makes the float32 sum non-finite, so a finite sum proves the
    tensor finite; only a non-finite sum (a NaN/Inf, or finite values so large
    their sum overflows) needs the exact check. On CPU the sum is far cheaper
    than ``isfinite().all()`` on bf16, where that check dominated the whole upload.
    """
    if bool(torch.isfinite(tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())


def tensor_problems(name: str, tensor: object, specs: dict[str, ParamSpec]) -> list[str]:
    """Everything wrong with one incoming tensor (empty when it is acceptable)."""
    if not isinstance(tensor, torch.Tensor):
        return [f"{name}: not a tensor ({type(tensor).__name__})"]
    spec = specs.get(name)
    if spec is None:
        return [f"{name}: unknown parameter name"]
    problems = []
    if tuple(tensor.shape) != spec.shape:
        problems.append(f"{name}: shape {list(tensor.shape)} != expected {list(spec.shape)}")
    if spec.dtype in FLOAT_DTYPES:
        if tensor.dtype not in FLOAT_DTYPES:
            problems.append(f"{name}: dtype {tensor.dtype} is not one of "
                            f"{[str(d) for d in FLOAT_DTYPES]}")
        elif tensor.numel() and not all_finite(tensor):
            bad = int((~torch.isfinite(tensor)).sum())
            problems.append(f"{name}: {bad} non-finite values (NaN/Inf)")
    elif tensor.dtype != spec.dtype:
        problems.append(f"{name}: dtype {tensor.dtype} != expected {spec.dtype}")
    if not problems and name.rsplit(".", 1)[-1] in ("d2t", "t2d"):
        problems.extend(index_map_problems(name, tensor, specs))
    return problems


def target_vocab_size(specs: dict[str, ParamSpec]) -> int | None:
    """The target vocabulary a draft's index maps point into, from the checkpoint's own shapes."""
    for name, spec in specs.items():
        if name.rsplit(".", 1)[-1] == "t2d":
            return spec.shape[0]
    for name in ("model.embed_tokens.weight", "embed_tokens.weight"):
        if name in specs:
            return specs[name].shape[0]
    return None


def index_map_problems(name: str, tensor: torch.Tensor, specs: dict[str, ParamSpec]) -> list[str]:
    """Values of the draft-vocabulary maps: vLLM indexes with them unchecked, so an out-of-range entry
    would read or write outside a tensor inside the engine. ``d2t[i]`` is an offset: draft token i
    is target token ``i + d2t[i]``, which must lie in the target vocabulary, distinct per i; ``t2d``
    marks exactly as many target tokens as the draft has."""
    vocab = target_vocab_size(specs)
    if name.rsplit(".", 1)[-1] == "d2t":
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
            return [f"{name}: must hold integer offsets, got {tensor.dtype}"]
        target_ids = torch.arange(tensor.numel(), dtype=torch.int64) + tensor.reshape(-1).to(torch.int64)
        bad = (target_ids < 0) | (target_ids >= vocab) if vocab else target_ids < 0
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            return [f"{name}: {int(bad.sum())} entries map outside the target vocabulary [0, {vocab}) "
                    f"(first: draft token {first} -> {int(target_ids[first])})"]
        if target_ids.unique().numel() != target_ids.numel():
            return [f"{name}: {target_ids.numel() - target_ids.unique().numel()} draft tokens map to a "
                    "target token another draft token already maps to"]
        return []
    draft_vocab = next((spec.shape[0] for n, spec in specs.items() if n.rsplit(".", 1)[-1] == "d2t"), None)
    if tensor.dtype == torch.bool and draft_vocab is not None and int(tensor.sum()) != draft_vocab:
        return [f"{name}: marks {int(tensor.sum())} target tokens, the draft vocabulary has {draft_vocab}"]
    return []


def missing_names(received: set[str], specs: dict[str, ParamSpec]) -> list[str]:
    """Names an update must still bring (updates are whole: every tensor, once)."""
    return sorted(n for n, spec in specs.items() if n not in received and n != TIED_HEAD and not spec.optional)
