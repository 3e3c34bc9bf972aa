"""The capture tap and the draft recorder: per-runner wraps that read each step's rows (worker side).

``GPUModelRunner.propose_draft_token_ids`` is called once per step, eagerly,
with the target's final hidden states and EAGLE-3 aux hidden states of every
scheduled row, right after sampling. Wrapping it
on the runner *instance* gives the tap everything it needs without touching
compiled graphs; the runner's per-step buffers are read (and copied) before
the original runs.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm_specrl.compat.registry import REGISTRY, Patch, PatchError
from vllm_specrl.cpu.samplers import _COMPACT_DRAFT_VOCAB, full_draft_probs

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
    query_starts = runner.query_start_loc.cpu[: n_reqs + 1].tolist()
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
        requests.append({"request_id": rid, "start": query_starts[i], "end": query_starts[i + 1], "num_spec": num_spec,
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


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_CHECKED = ("vLLM 0.32.0, CPU",)
_PROPOSE_SIGNATURE = ("scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                     "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
                     "slot_mappings")
# On one runner, over the class's patches (custom_binding, deferred_kv): the tap, then the recorder.
CAPTURE_TAP_ORDER, DRAFT_RECORDER_ORDER = 10, 11
_TAP_WHY = ("capture: the hidden states, tokens and logprobs of committed rows, read before each draft "
            "proposal, for the online draft trainer (every platform where capture is configured)")
CAPTURE_TAP_PATCH = REGISTRY.declare(Patch(
    name="capture_tap", target=f"{_RUNNER}.propose_draft_token_ids", why=_TAP_WHY, scope="everywhere",
    switch="VLLM_SPECRL_CAPTURE_TAP", checked_on=_CHECKED, signature=_PROPOSE_SIGNATURE, order=CAPTURE_TAP_ORDER))
CAPTURE_LOGITS_PATCH = REGISTRY.declare(Patch(
    name="capture_tap.sample_tokens", target=f"{_RUNNER}.sample_tokens", why=_TAP_WHY + ": the step's logits",
    scope="everywhere", switch="VLLM_SPECRL_CAPTURE_TAP", checked_on=_CHECKED, signature=("grammar_output",),
    order=CAPTURE_TAP_ORDER))
CAPTURE_LOGP_PATCH = REGISTRY.declare(Patch(
    name="capture_tap.compute_logprobs", target="vllm.v1.sample.sampler:Sampler.compute_logprobs",
    why=_TAP_WHY + ": the sampler's log-softmax kept, not taken twice", scope="everywhere",
    switch="VLLM_SPECRL_CAPTURE_TAP", checked_on=_CHECKED, signature=("logits",), order=CAPTURE_TAP_ORDER))
DRAFT_RECORDER_PATCH = REGISTRY.declare(Patch(
    name="draft_recorder", target=f"{_RUNNER}.propose_draft_token_ids",
    why="what the drafter proposed and with what probabilities, read out of the running engine (drafter "
        "parity tests and diagnostics; installed only when asked for)",
    scope="everywhere", switch="VLLM_SPECRL_DRAFT_RECORDER", checked_on=_CHECKED, signature=_PROPOSE_SIGNATURE,
    order=DRAFT_RECORDER_ORDER))


def _propose_signature(runner: Any) -> inspect.Signature:
    """The runner's ``propose_draft_token_ids`` parameters as its class defines them (class patches keep
    them visible through ``functools.wraps``), whatever per-runner wraps are on it already."""
    return inspect.signature(type(runner).propose_draft_token_ids.__get__(runner))


def install_capture_tap(runner: Any, on_step: Any) -> str:
    """Call ``on_step(view)`` with ``capture_step_view(...)`` before each draft proposal.

    Also keeps a reference to the step's target logits (``execute_model_state.logits``, computed by
    ``execute_model`` and consumed by ``sample_tokens``, which calls the proposer) so the tap can send
    the sampled tokens' logprobs without a second LM-head pass, and keeps the log-softmax of them that
    the step's sampler takes for requests asking for logprobs (vLLM's ``Sampler.compute_logprobs``,
    an instance override) or the one-pass verify takes at T = 1 (``raw_logprobs``: the tap takes no
    second one).
    """
    if hasattr(runner, "speculator") and not hasattr(runner, "drafter"):
        return _install_speculator_tee(runner, on_step)
    if getattr(runner, "_specrl_capture_on_step", None) is not None:
        runner._specrl_capture_on_step = on_step
        return "replaced"
    signature = _propose_signature(runner)

    def keep_logp(logits: Any, logp: Any) -> None:
        runner._specrl_step_logp = (logits, logp)

    def wrap_propose(original: Any) -> Any:
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
        return propose_draft_token_ids

    def wrap_sample(original: Any) -> Any:
        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            state = getattr(runner, "execute_model_state", None)
            runner._specrl_step_logits = getattr(state, "logits", None)
            try:
                return original(*args, **kwargs)
            finally:
                runner._specrl_step_logits = runner._specrl_step_logp = None
        return sample_tokens

    def wrap_logprobs(original: Any) -> Any:
        def compute_logprobs(logits: Any) -> Any:
            logp = original(logits)
            keep_logp(logits, logp)
            return logp
        return compute_logprobs

    result = REGISTRY.install(CAPTURE_TAP_PATCH, wrap_propose, on=runner)
    if result != "installed":
        return result
    runner._specrl_capture_on_step = on_step
    logits = REGISTRY.install(CAPTURE_LOGITS_PATCH, wrap_sample, on=runner)
    if logits != "installed":
        result += f" (rows sent without logprobs: {logits})"
    verifier, sampler = getattr(runner, "rejection_sampler", None), getattr(runner, "sampler", None)
    if verifier is not None:
        verifier._specrl_keep_logp = keep_logp
    if sampler is not None and callable(getattr(sampler, "compute_logprobs", None)):
        REGISTRY.install(CAPTURE_LOGP_PATCH, wrap_logprobs, on=sampler)
    return result


class CaptureUnavailable(RuntimeError):
    """Capture was asked of an engine whose drafter cannot tee its rows."""


def _install_speculator_tee(runner: Any, on_step: Any) -> str:
    """Model Runner V2 (vLLM >= 0.34): no runner patch; the registered capturing speculator's tee takes the
    tap. Any other speculator cannot capture: say which method can, rather than capture nothing."""
    tee = getattr(runner.speculator, "specrl_capture", None)
    if tee is None:
        method = getattr(getattr(runner, "speculative_config", None), "method", None)
        raise CaptureUnavailable(
            f"capture on Model Runner V2 (vLLM >= 0.34) needs a capturing speculator: serve with "
            f"--speculative-config method 'specrl_eagle3' (an EAGLE-3 draft) or 'specrl_mtp' (MTP layers), "
            f"not {method!r}")
    replaced = tee.tap is not None
    tee.tap = on_step
    return "replaced" if replaced else "installed (Model Runner V2: the speculator's capture tee)"


def speculator_tee(runner: Any) -> Any:
    """The capture tee of a Model Runner V2 capturing speculator, or None."""
    return getattr(getattr(runner, "speculator", None), "specrl_capture", None)


def remove_capture_tap(runner: Any) -> None:
    """Take the tap off the runner (vLLM's methods, or the recorder's, again)."""
    tee = speculator_tee(runner)
    if tee is not None:
        tee.tap = None
        return
    if getattr(runner, "_specrl_capture_on_step", None) is None:
        return
    sampler = getattr(runner, "sampler", None)
    for patch, owner in ((CAPTURE_TAP_PATCH, runner), (CAPTURE_LOGITS_PATCH, runner), (CAPTURE_LOGP_PATCH, sampler)):
        try:
            REGISTRY.uninstall(patch.name, on=owner)
        except PatchError:
            pass  # not installed there (skipped, or never installed)
    runner._specrl_capture_on_step = runner._specrl_step_logp = None
    verifier = getattr(runner, "rejection_sampler", None)
    if verifier is not None:
        verifier._specrl_keep_logp = None


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
    import torch

    if on_draft is None:
        if getattr(runner, "_specrl_on_draft", None) is not None:
            REGISTRY.uninstall(DRAFT_RECORDER_PATCH.name, on=runner)
        runner._specrl_on_draft = None
        return "removed"
    if getattr(runner, "_specrl_on_draft", None) is not None:
        runner._specrl_on_draft = on_draft
        return "installed"
    signature = _propose_signature(runner)

    def wrap(original: Any) -> Any:
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
        return propose_draft_token_ids

    result = REGISTRY.install(DRAFT_RECORDER_PATCH, wrap, on=runner)
    if result == "installed":
        runner._specrl_on_draft = on_draft
    return result
