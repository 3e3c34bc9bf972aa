"""The drafter lifecycle's settings: ``--additional-config '{"specrl": {"drafter": {...}}}'``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

ON_DAMAGE = ("repair", "report", "refuse")
# vLLM's speculative methods that serve a draft model (the only drafters with weights to keep)
DRAFT_MODEL_METHODS = ("eagle", "eagle3", "mtp", "draft_model")


@dataclass(frozen=True)
class DrafterConfig:
    """``on_damage``: what a drafter changed behind the plugin's back gets: ``repair`` (restored from the
    host copy before the next drafting step), ``report`` (flagged only), ``refuse`` (k = 0 until a draft
    update arrives). ``check_every_s``: the periodic fingerprint check with no event (0: every step;
    negative: off). ``collapse_*``: the alarm (see ``collapse.CollapseDetector``)."""

    on_damage: str = "repair"
    check_every_s: float = 30.0
    collapse_window: int = 64
    collapse_below: float = 1.05
    collapse_drop: float = 0.25

    @classmethod
    def from_dict(cls, raw: Any) -> DrafterConfig:
        if raw in (None, True):
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f"specrl.drafter must be an object of {sorted(f.name for f in fields(cls))}, "
                             f"not {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"specrl.drafter: unknown keys {unknown} (known: {sorted(known)})")
        config = cls(**{k: type(getattr(cls(), k))(v) for k, v in raw.items()})
        if config.on_damage not in ON_DAMAGE:
            raise ValueError(f"specrl.drafter.on_damage must be one of {ON_DAMAGE}, not {config.on_damage!r}")
        if config.collapse_window < 1:
            raise ValueError("specrl.drafter.collapse_window must be >= 1")
        return config

    @classmethod
    def of(cls, vllm_config: Any) -> DrafterConfig:
        from vllm_specrl.compat.engine_config import specrl_additional_config

        return cls.from_dict(specrl_additional_config(vllm_config).get("drafter"))
