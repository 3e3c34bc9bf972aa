"""What the Model Runner V2 port relies on in vLLM's source (vLLM >= 0.34), declared into the registry
with ``runner="mrv2"``: ``scripts/check_vllm_touch_points.py --wheel`` checks them against a vLLM that
has the speculator registry, and leaves them out on one that does not (0.32, 0.33)."""

from __future__ import annotations

from vllm_specrl.compat.registry import REGISTRY, TouchPoint

_SD = "v1/worker/gpu/spec_decode"
_PROPOSE = ("self", "input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states",
            "num_sampled", "num_rejected", "last_sampled", "next_prefill_tokens", "temperature", "seeds",
            "dp_sync_state=", "dummy_run=", "skip_attn_for_dummy_run=", "mm_inputs=", "is_profile=",
            "num_speculative_tokens=")


def _mrv2(file: str, name: str, kind: str, used_for: str, *signatures: tuple[str, ...]) -> TouchPoint:
    return TouchPoint(file, name, kind, used_for, runner="mrv2", signatures=signatures)


REGISTRY.reads(
    _mrv2(f"{_SD}/speculator_config.py", "", "names:register_speculative_method,SpeculatorConfig",
          "the package's methods registered from the general plugin"),
    _mrv2(f"{_SD}/speculator_config.py", "register_speculative_method", "function",
          "the package's methods registered by qualified name", ("name", "config_cls")),
    _mrv2(f"{_SD}/speculator_config.py", "SpeculatorConfig",
          "attrs:base_method,speculator_class,adaptive_verification_uses_draft_logits,configure",
          "specrl_history's config"),
    _mrv2(f"{_SD}/speculator_config.py", "SpeculatorConfig.configure", "function",
          "specrl_history's config checks k, then vLLM's setup", ("cls", "spec")),
    _mrv2(f"{_SD}/eagle/config.py", "Eagle3SpeculatorConfig", "class", "specrl_eagle3's config subclasses it"),
    _mrv2(f"{_SD}/mtp/config.py", "MTPSpeculatorConfig", "class", "specrl_mtp's config subclasses it"),
    _mrv2(f"{_SD}/__init__.py", "init_speculator", "function",
          "speculators built with (vllm_config, device, req_states=) where the constructor takes req_states",
          ("vllm_config", "device", "req_states")),
    _mrv2(f"{_SD}/speculator.py", "BaseSpeculator.propose", "function",
          "every speculator's propose (the capture tee's and the history speculator's override)", _PROPOSE),
    _mrv2(f"{_SD}/speculator.py", "BaseSpeculator",
          "attrs:init_cudagraph_manager,capture,propose,on_requests_finished,reset_state",
          "the history speculator's interface"),
    _mrv2(f"{_SD}/target_dependent_ar/speculator.py", "TargetDependentARSpeculator.__init__", "function",
          "capturing EAGLE / MTP speculators call it with (vllm_config, device)", ("self", "vllm_config", "device")),
    _mrv2(f"{_SD}/eagle/speculator.py", "EagleSpeculator", "class", "specrl_eagle3's speculator subclasses it"),
    _mrv2(f"{_SD}/mtp/speculator.py", "MTPSpeculator", "class", "specrl_mtp's speculator subclasses it"),
    _mrv2("v1/worker/gpu/input_batch.py", "InputBatch",
          "attrs:req_ids,num_reqs,num_tokens,query_start_loc_np,idx_mapping,idx_mapping_np,"
          "num_draft_tokens_per_req,input_ids,positions",
          "capture view and history drafts read the step's batch"),
    _mrv2("v1/worker/gpu/states.py", "RequestState", "attrs:all_token_ids,total_len,prompt_len,last_sampled_tokens",
          "history drafts read each request's tokens; capture reads prompt lengths"),
    _mrv2("v1/worker/gpu/model_runner.py", "GPUModelRunner", "attrs:speculator,req_states",
          "the worker finds the speculator (capture, history versions, the drafter's lifecycle)"),
    _mrv2("config/speculative.py", "SpeculativeConfig", "attrs:custom_method,method,num_speculative_tokens",
          "a registered method's name after vLLM resolves it to its base"),
)
