"""The CPU sampling patches: ``samplers``' exact samplers bound in place of vLLM's, and the
plain sampler for steps without drafts.

Each is a registry patch with scope ``cpu``: its reason is a CPU step cost, measured on the CPU
platform only (``scripts/bench/bench_step_cost.py``), so elsewhere it stays off unless its switch says
``1``. ``VLLM_SPECRL_FAST_SAMPLING=0`` keeps every sampler of vLLM's; ``VLLM_SPECRL_LAZY_REJECTION=0``
keeps its rejection sampling and logprobs, ``VLLM_SPECRL_ONE_PASS_VERIFY=0`` its verify forward,
``VLLM_SPECRL_DRAFT_VOCAB_SAMPLING=0`` its full-vocabulary draft sampling.
"""

from __future__ import annotations

import os

from vllm_specrl.compat.registry import REGISTRY, Patch
from vllm_specrl.cpu import samplers as fast
from vllm_specrl.cpu.samplers import (DRAFT_VOCAB_ENV, FAST_SAMPLING_ENV, LAZY_REJECTION_ENV,
                                      ONE_PASS_VERIFY_ENV)

_CHECKED = ("vLLM 0.32.0, CPU",)
_RS = "vllm.v1.sample.rejection_sampler"
_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer"
_WHY = "(CPU step cost: bench_step_cost --sampling fast,eager)"
# vLLM 0.33.0 (read, not run): FLy's three trailing parameters, handed to vLLM's own when FLy is on.
_REJECTION_SAMPLE_0_33 = ("draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs",
                          "target_logits", "bonus_token_ids", "sampling_metadata", "synthetic_mode",
                          "synthetic_conditional_rates", "use_fp64_gumbel", "fly_window_size",
                          "fly_entropy_threshold", "fly_entropy_top_k")

# (patch, replacement): inverse-CDF draft and recovered-token sampling, then the lazy rejection and
# its emitted-row logprobs, the one-pass verify, and draft sampling in the draft's own vocabulary.
FAST_SAMPLING_PATCHES = tuple((REGISTRY.declare(patch), replacement) for patch, replacement in (
    (Patch(shortcut=True, name=fast.DRAFT_SAMPLE, target=f"{_PROPOSER}:compute_probs_and_sample_next_token",
           why=f"draft tokens by inverse-CDF sampling from one uniform per row, not an exponential race "
               f"over the vocabulary; same distribution {_WHY}",
           scope="cpu", switch=FAST_SAMPLING_ENV, checked_on=_CHECKED,
           signature=("logits", "sampling_metadata", "use_fp64_gumbel")), fast.fast_draft_sample),
    (Patch(shortcut=True, name=fast.RECOVERED_TOKENS, target=f"{_RS}:sample_recovered_tokens",
           why=f"recovered tokens by inverse-CDF sampling of max(p - q, 0); same distribution {_WHY}",
           scope="cpu", switch=FAST_SAMPLING_ENV, checked_on=_CHECKED,
           signature=("max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids",
                      "draft_probs", "target_probs", "sampling_metadata", "device", "use_fp64_gumbel")),
     fast.fast_recovered_sample),
    (Patch(shortcut=True, name=fast.LAZY_REJECTION, target=f"{_RS}:rejection_sample",
           why=f"a recovered token drawn only at the row that emits one, not at every draft row; a padded "
               f"-1 draft rejected as vLLM's Triton kernel does {_WHY}",
           scope="cpu", switch=LAZY_REJECTION_ENV, checked_on=_CHECKED,
           signature=("draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens",
                      "draft_probs", "target_logits", "bonus_token_ids", "sampling_metadata", "synthetic_mode",
                      "synthetic_conditional_rates", "use_fp64_gumbel"),
           also_checked=(_REJECTION_SAMPLE_0_33,),
           repro="scripts/repro/repro_cpu_padded_draft_accepted.py"), fast.fast_rejection_sample),
    (Patch(shortcut=True, name=fast.EMITTED_LOGPROBS, target=f"{_RS}:RejectionSampler._get_logprobs_tensors",
           why=f"logprobs scored for the emitted rows only, not every draft row {_WHY}",
           scope="cpu", switch=LAZY_REJECTION_ENV, checked_on=_CHECKED,
           signature=("self", "max_num_logprobs", "metadata", "logits", "target_logits", "bonus_logits",
                      "sampled_token_ids")), fast.fast_logprobs_tensors),
    (Patch(shortcut=True, name=fast.ONE_PASS_VERIFY, target=f"{_RS}:RejectionSampler.forward",
           why=f"a verify step of temperature-only sampled requests from one log-softmax of its rows {_WHY}",
           scope="cpu", switch=ONE_PASS_VERIFY_ENV, checked_on=_CHECKED,
           signature=("self", "metadata", "draft_probs", "logits", "sampling_metadata")),
     fast.one_pass_rejection_forward),
    (Patch(shortcut=True, name=fast.DRAFT_VOCAB, target=f"{_PROPOSER}:SpecDecodeBaseProposer._sample_draft_tokens",
           why=f"an EAGLE-3 draft with a reduced vocabulary sampled in it, not spread over the target's {_WHY}",
           scope="cpu", switch=DRAFT_VOCAB_ENV, checked_on=_CHECKED,
           signature=("self", "hidden_states", "sampling_metadata")), fast.draft_vocab_sample_draft_tokens),
))
# Switched off with vLLM's rejection sampling: the patches that only serve it.
_NEEDS_LAZY = (fast.EMITTED_LOGPROBS, fast.ONE_PASS_VERIFY)


def install_cpu_fast_sampling() -> str:
    """Bind ``cpu_samplers``' functions in place of vLLM's where each applies; a summary of the states."""
    states = []
    for patch, replacement in FAST_SAMPLING_PATCHES:
        if REGISTRY.is_installed(patch.name):
            states.append("installed")
        elif os.environ.get(FAST_SAMPLING_ENV, "1") == "0":
            states.append(REGISTRY.skip(patch, f"off ({FAST_SAMPLING_ENV}=0)"))
        elif patch.name in _NEEDS_LAZY and os.environ.get(LAZY_REJECTION_ENV, "1") == "0":
            states.append(REGISTRY.skip(patch, f"off ({LAZY_REJECTION_ENV}=0)"))
        else:
            states.append(REGISTRY.install(patch, lambda stock, fn=replacement: fn))
    installed = states.count("installed")
    if installed == len(states):
        return "installed"
    return f"{installed} of {len(states)} installed" + "".join(
        f"; {patch.name}: {state}" for (patch, _), state in zip(FAST_SAMPLING_PATCHES, states) if state != "installed")


def uninstall_cpu_fast_sampling() -> None:
    """Restore vLLM's samplers (tests compare both in one process)."""
    for patch, _ in FAST_SAMPLING_PATCHES:
        if REGISTRY.is_installed(patch.name):
            REGISTRY.uninstall(patch.name)


ZERO_DRAFT_ENV = "VLLM_SPECRL_ZERO_DRAFT_PLAIN_SAMPLER"
ZERO_DRAFT_PATCH = REGISTRY.declare(Patch(shortcut=True,
    name="zero_draft_plain_sampler", target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
    why="a step without drafts (adaptive k at 0) takes the plain sampler, whose output equals the rejection "
        "sampler's there, skipping its bonus sample, softmax and constraints (CPU step cost: "
        "bench_step_cost --held-at 0)",
    scope="cpu", switch=ZERO_DRAFT_ENV, checked_on=_CHECKED, signature=("self", "logits", "spec_decode_metadata")))


ZERO_DRAFT_METADATA_PATCH = REGISTRY.declare(Patch(shortcut=True,
    name="zero_draft_plain_sampler.metadata",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._calc_spec_decode_metadata",
    why="a step without drafts gets its spec-decode metadata (one logit per request, no draft) from the "
        "query ends directly, not vLLM's cumsum/repeat/gather pipeline (CPU step cost: per-method timers, "
        "benchmarks/JOURNAL.md, issue 54's floor)",
    scope="cpu", switch=ZERO_DRAFT_ENV, checked_on=_CHECKED,
    signature=("self", "num_draft_tokens", "cu_num_scheduled_tokens")))


def install_zero_draft_plain_sampler() -> str:
    """Route steps without drafts to the plain sampler and their metadata to the short path; counts
    the steps on the runner."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    if REGISTRY.is_installed(ZERO_DRAFT_PATCH.name):
        return "installed"

    def wrap(stock):
        def _sample(self, logits, spec_decode_metadata):
            if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
                self._specrl_zero_draft_steps = getattr(self, "_specrl_zero_draft_steps", 0) + 1
                spec_decode_metadata = None
            return stock(self, logits, spec_decode_metadata)
        return _sample

    def wrap_metadata(stock):
        def _calc_spec_decode_metadata(self, num_draft_tokens, cu_num_scheduled_tokens):
            if num_draft_tokens.any():
                return stock(self, num_draft_tokens, cu_num_scheduled_tokens)
            # vLLM's result with every count 0: each request's one sampled logit is its last scheduled
            # token; no draft, no target logit; the bonus logit of request i is row i.
            n = len(num_draft_tokens)
            self._specrl_zero_draft_metadata = getattr(self, "_specrl_zero_draft_metadata", 0) + 1
            return SpecDecodeMetadata(
                draft_token_ids=self.input_ids.gpu[:0],
                num_draft_tokens=[0] * n,
                cu_num_draft_tokens=torch.zeros(n, dtype=torch.int32, device=self.device),
                cu_num_sampled_tokens=torch.arange(1, n + 1, dtype=torch.int32, device=self.device),
                target_logits_indices=torch.empty(0, dtype=torch.int32, device=self.device),
                bonus_logits_indices=torch.arange(n, dtype=torch.int32, device=self.device),
                logits_indices=torch.from_numpy(cu_num_scheduled_tokens[:n] - 1).to(self.device))
        return _calc_spec_decode_metadata

    return REGISTRY.install_all([(ZERO_DRAFT_PATCH, wrap), (ZERO_DRAFT_METADATA_PATCH, wrap_metadata)])
