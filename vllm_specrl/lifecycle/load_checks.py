"""Checks at load: a draft that cannot cover the engine's positions or vocabulary is refused or warned
about at start-up, with the numbers, rather than found later as an acceptance collapse.

- positions: the drafter's rotary table must have a row for every position the engine serves
  (``max_model_len``); fewer rows and vLLM reads past it or clamps (NeMo RL #3960), so the engine is
  refused. A draft configured for a shorter range than the engine serves (``max_position_embeddings``
  in its own config.json, times its RoPE scaling factor) is warned about: vLLM (0.32) raises the
  draft's range to the target's, but the draft was trained for the shorter one.
- vocabulary: an EAGLE-3 draft's ``d2t`` must map every draft token into the target's vocabulary
  (vLLM indexes with it unchecked), one target token per draft token, and match the draft's LM head;
  ``t2d`` must have one entry per target token. A draft without maps must share the target's
  vocabulary size.

The outcome is in every worker's status (``weight_watch.load_checks``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vllm_specrl._log import logger
from vllm_specrl.compat import engine_config

_SCALED_ROPE = ("linear", "dynamic", "yarn", "llama3", "longrope")


class DraftRefused(ValueError):
    """The draft cannot serve this engine (the message has the numbers)."""


def rotary_rows(model: Any) -> int | None:
    """The fewest rows of any rotary table in ``model`` (positions it can rotate), or None."""
    rows = [int(m.cos_sin_cache.shape[0]) for m in model.modules()
            if isinstance(getattr(m, "cos_sin_cache", None), torch.Tensor)]
    return min(rows) if rows else None


def configured_range(config: dict) -> tuple[int | None, float]:
    """The positions a draft's own config.json says it covers: ``max_position_embeddings`` and the RoPE
    scaling factor that extends it (1.0 without scaling)."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, dict) else None
    factor = float(scaling.get("factor", 1.0)) if kind in _SCALED_ROPE else 1.0
    base = scaling.get("original_max_position_embeddings") if kind in _SCALED_ROPE else None
    positions = base or config.get("max_position_embeddings")
    return (int(positions) if positions else None), factor


def position_findings(max_model_len: int, rotary: int | None, config: dict) -> tuple[list[str], list[str]]:
    """(errors, warnings) about the positions a draft covers."""
    errors, warnings = [], []
    if rotary is not None and rotary < max_model_len:
        errors.append(f"the drafter's rotary table has {rotary} positions, the engine serves max_model_len "
                      f"{max_model_len}: drafts past position {rotary} would read outside it (set the draft's "
                      f"max_position_embeddings to at least {max_model_len}, or serve --max-model-len {rotary})")
    positions, factor = configured_range(config)
    if positions is not None and positions * factor < max_model_len:
        warnings.append(f"the draft's config covers {int(positions * factor)} positions "
                        f"(max_position_embeddings {positions}" + (f" x RoPE factor {factor:g}" if factor != 1 else "")
                        + f"), the engine serves max_model_len {max_model_len}: drafts past position "
                        f"{int(positions * factor)} run where the draft was not trained, and acceptance may fall there")
    return errors, warnings


def vocabulary_findings(tensors: dict[str, torch.Tensor], target_vocab: int, draft_vocab: int | None) -> list[str]:
    """Errors in how a draft's vocabulary maps onto the target's."""
    errors = []
    d2t = next((t for n, t in tensors.items() if n.rsplit(".", 1)[-1] == "d2t"), None)
    t2d = next((t for n, t in tensors.items() if n.rsplit(".", 1)[-1] == "t2d"), None)
    if d2t is not None:
        ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.reshape(-1).to(torch.int64)
        outside = int(((ids < 0) | (ids >= target_vocab)).sum())
        if outside:
            errors.append(f"d2t maps {outside} of {d2t.numel()} draft tokens outside the target vocabulary "
                          f"[0, {target_vocab})")
        elif ids.unique().numel() != ids.numel():
            errors.append(f"d2t maps {ids.numel() - ids.unique().numel()} draft tokens onto a target token "
                          "another draft token maps to")
        if draft_vocab is not None and d2t.numel() != draft_vocab:
            errors.append(f"d2t has {d2t.numel()} entries, the draft's LM head {draft_vocab} rows")
    elif draft_vocab is not None and draft_vocab != target_vocab:
        errors.append(f"the draft's LM head has {draft_vocab} rows and no d2t map; the target's vocabulary "
                      f"has {target_vocab} tokens")
    if t2d is not None and t2d.numel() != target_vocab:
        errors.append(f"t2d has {t2d.numel()} entries, the target vocabulary {target_vocab} tokens")
    return errors


def _draft_config(worker: Any) -> dict:
    if engine_config.policy_mtp_drafter(worker) is not None:
        return {}  # the policy's own layers: its positions and vocabulary are the target's
    try:
        return json.loads((Path(engine_config.draft_checkpoint_dir(worker)) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return {}


def _lm_head_rows(tensors: dict[str, torch.Tensor]) -> int | None:
    head = tensors.get("lm_head.weight")
    return int(head.shape[0]) if head is not None else None


def check_loaded_draft(worker: Any) -> dict | None:
    """Run the checks on the drafter just loaded; raise ``DraftRefused`` on an error, log warnings, and
    keep the findings in the weight watch's state."""
    from vllm_specrl.sync.watch.worker_loads import served_models, watch_of

    drafts = served_models(worker)["draft"]
    if not drafts:
        return None
    max_model_len = int(worker.vllm_config.model_config.max_model_len)
    rotary = rotary_rows(drafts[0])
    errors, warnings = position_findings(max_model_len, rotary, _draft_config(worker))
    good = worker._specrl_stager().last_good["draft"]
    if isinstance(good, dict) and engine_config.policy_mtp_drafter(worker) is None:
        errors += vocabulary_findings(good, int(worker.vllm_config.model_config.get_vocab_size()),
                                      _lm_head_rows(good))
    findings = {"errors": errors, "warnings": warnings, "max_model_len": max_model_len,
                "rotary_positions": rotary}
    watch_of(worker).load_checks = findings
    for warning in warnings:
        logger.warning("vllm-specrl: %s", warning)
    if errors:
        raise DraftRefused("vllm-specrl refused the draft at load: " + "; ".join(errors))
    return findings
