"""A custom_class proposer sees the runner's batch and hands back its draft probabilities.

vLLM 0.32 calls a ``custom_class`` proposer with the batch's token rows only
(``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)``).
A proposer that keys on requests (the history proposer: prompt groups, requests
that finished) also needs ``input_batch.req_ids`` / ``num_prompt_tokens`` (row
order = the propose call's) and the step's k (``scheduler_output.
num_spec_tokens_to_schedule``: adaptive k). A class wrap of
``GPUModelRunner.propose_draft_token_ids`` hands them to any drafter with a
``bind_step(input_batch, k_limit)`` method just before the stock call.

vLLM takes draft probabilities only from its own model-based drafters (the EAGLE
branch reads ``drafter.take_last_draft_probs()`` into ``runner._draft_probs`` /
``_draft_prob_req_ids``, rows in ``input_batch.req_ids`` order); for ``custom_class``
it leaves them None, so every custom draft is verified as a token-id draft. The same
wrap hands a custom drafter's ``take_last_draft_probs()`` (``[rows, k, vocab]``) to
the runner the same way, so the next step's rejection sampler accepts with
``min(1, p / q)`` and resamples from ``max(p - q, 0)`` (the history proposer's
sampled drafts).
"""

from __future__ import annotations

import functools

from vllm_specrl.compat.registry import REGISTRY, Patch

CUSTOM_BINDING_ENV = "VLLM_SPECRL_CUSTOM_PROPOSER_BINDING"
# Patches on GPUModelRunner.propose_draft_token_ids, innermost (closest to vLLM's) first.
DEFERRED_KV_ORDER, CUSTOM_BINDING_ORDER = 1, 2
CUSTOM_BINDING_PATCH = REGISTRY.declare(Patch(
    name="custom_proposer_binding",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
    why="vLLM 0.32 hands a custom_class proposer neither the batch's request ids and prompt lengths nor the "
        "step's k, and passes no draft probabilities to the rejection sampler: without them the history "
        "proposer cannot draft per request nor have its sampled drafts verified losslessly (every platform)",
    scope="everywhere", switch=CUSTOM_BINDING_ENV, checked_on=("vLLM 0.32.0, CPU",), order=CUSTOM_BINDING_ORDER))


def install_custom_proposer_binding() -> str:
    """Wrap the runner's ``propose_draft_token_ids`` so ``custom_class`` drafters see the batch."""
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
