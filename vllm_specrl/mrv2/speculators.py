"""The package's speculators on Model Runner V2 (vLLM >= 0.34; written against 0.34.0's source, not run:
no vLLM build that runs Model Runner V2 runs on the project's machines).

vLLM builds the class its registered config names (``speculator_class``) with ``(vllm_config, device)``,
plus ``req_states`` where the constructor takes it (``vllm.v1.worker.gpu.spec_decode.init_speculator``).

- ``CapturingEagleSpeculator`` / ``CapturingMTPSpeculator``: vLLM's EAGLE and MTP speculators as they
  are, with the capture tee in front of ``propose`` (the step's hidden states and committed rows, handed
  to the tap the worker installs with ``specrl_capture_start``).
- ``HistorySpeculator``: the rollout-history proposer (``proposer.history``) behind vLLM's
  speculator interface.

Importing this module imports vLLM's Model Runner V2 speculators (vLLM >= 0.34).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

from vllm_specrl.mrv2.capture_view import CaptureTee
from vllm_specrl.mrv2.history_speculator import HistoryDrafts


class _CaptureMixin:
    """The tee in front of a target-dependent speculator's ``propose``."""

    specrl_drafter = "eagle3"

    def _init_capture(self, req_states: Any) -> None:
        self.specrl_req_states = req_states
        self.specrl_capture = CaptureTee(self.specrl_drafter)

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None,
                is_profile=False, num_speculative_tokens=None) -> torch.Tensor:
        if not dummy_run and not is_profile:
            states = self.specrl_req_states
            self.specrl_capture.offer(input_batch, last_hidden_states, aux_hidden_states, num_sampled,
                                      num_rejected, last_sampled,
                                      states.prompt_len.np if states is not None else None)
        return super().propose(  # type: ignore[misc]
            input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
            num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, dp_sync_state=dp_sync_state,
            dummy_run=dummy_run, skip_attn_for_dummy_run=skip_attn_for_dummy_run, mm_inputs=mm_inputs,
            is_profile=is_profile, num_speculative_tokens=num_speculative_tokens)


class CapturingEagleSpeculator(_CaptureMixin, EagleSpeculator):
    """vLLM's EAGLE / EAGLE-3 speculator with the capture tee (method ``specrl_eagle3``)."""

    def __init__(self, vllm_config: Any, device: torch.device, req_states: Any = None):
        super().__init__(vllm_config, device)
        self._init_capture(req_states)


class CapturingMTPSpeculator(_CaptureMixin, MTPSpeculator):
    """vLLM's MTP speculator with the capture tee (method ``specrl_mtp``)."""

    specrl_drafter = "mtp"

    def __init__(self, vllm_config: Any, device: torch.device, req_states: Any = None):
        super().__init__(vllm_config, device)
        self._init_capture(req_states)


class HistorySpeculator(BaseSpeculator):
    """The rollout-history proposer as a Model Runner V2 speculator (method ``specrl_history``): drafts
    are host look-ups over the request's prompt group, verified as token-id drafts."""

    def __init__(self, vllm_config: Any, device: torch.device, req_states: Any):
        self.history = HistoryDrafts(vllm_config, device, req_states)

    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        del cudagraph_mode  # no forward of its own

    def capture(self) -> None:
        return None

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None,
                is_profile=False, num_speculative_tokens=None) -> torch.Tensor:
        return self.history.propose(input_batch, num_sampled, dummy_run or is_profile, num_speculative_tokens)

    def on_requests_finished(self, finished_req_ids: set[str]) -> None:
        self.history.finished(finished_req_ids)

    def reset_state(self) -> None:
        self.history.reset()

    def on_policy_version(self, version: int) -> None:
        """The worker's policy commit: the history ages by one version."""
        self.history.proposer.on_policy_version(version)

    def specrl_status(self) -> dict:
        return self.history.proposer.specrl_status()
