"""The vLLM face of the EAGLE-3 draft, registered by the general plugin.

It is vLLM's own ``Eagle3LlamaForCausalLM`` (so the native ``eagle3`` method
gives it the target's aux hidden states, a draft KV cache, CUDA graphs and
draft probabilities for lossless verification), plus a start-up check that
names every way a draft does not fit its target, instead of a shape error deep
inside a matmul.
"""

from __future__ import annotations

from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

from vllm_specrl.compat import engine_config
from vllm_specrl.proposer.eagle3_config import check_fits_target


class SpecRLEagle3LlamaForCausalLM(Eagle3LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        draft_cfg, target = engine_config.draft_and_target_configs(vllm_config)
        check_fits_target(draft_cfg, target["hidden_size"], target["vocab_size"], target["num_layers"])
        super().__init__(vllm_config=vllm_config, prefix=prefix)
