"""The package's speculative methods as vLLM 0.34 declares one: a ``SpeculatorConfig`` subclass per method,
registered by name from the general plugin (``registration``). Each subclasses the config of the built-in
method it behaves like, so vLLM's own setup (draft checkpoint, rotary range, k from the checkpoint) and
every check vLLM makes by behaviour rather than by name apply unchanged; only ``speculator_class`` is ours.

Config modules must not import speculators (vLLM imports them in every process, the API server's too):
``speculator_class`` is a qualified name, resolved in the worker.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu.spec_decode.eagle.config import Eagle3SpeculatorConfig
from vllm.v1.worker.gpu.spec_decode.mtp.config import MTPSpeculatorConfig
from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig

_SPECULATORS = "vllm_specrl.mrv2.speculators"


class SpecRLEagle3Config(Eagle3SpeculatorConfig):
    """``specrl_eagle3``: vLLM's EAGLE-3, with the capture tee for the online draft trainer."""

    speculator_class = f"{_SPECULATORS}.CapturingEagleSpeculator"


class SpecRLMTPConfig(MTPSpeculatorConfig):
    """``specrl_mtp``: vLLM's MTP (the policy's own MTP layers), with the capture tee."""

    speculator_class = f"{_SPECULATORS}.CapturingMTPSpeculator"


class HistorySpeculatorConfig(SpeculatorConfig):
    """``specrl_history``: drafts from the request's prompt group (earlier rollouts, siblings in flight).
    No draft model: the target's config stands in for the draft's (``SpeculatorConfig.configure``)."""

    speculator_class = f"{_SPECULATORS}.HistorySpeculator"
    # Acceptance confidences for vLLM's adaptive verification come from acceptance rates, not draft
    # logits (it has none), as for vLLM's suffix method.
    adaptive_verification_uses_draft_logits = False

    @classmethod
    def configure(cls, spec: Any) -> None:
        if spec.num_speculative_tokens is None:
            raise ValueError("method 'specrl_history' needs num_speculative_tokens (the most tokens a look-up "
                             "drafts per step)")
        super().configure(spec)
