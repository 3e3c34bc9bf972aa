"""Weight updates for an in-process ``vllm.LLM`` (a colocated trainer, a test): the worker
extension's validated, atomic, versioned commit, without the HTTP routes ``EngineClient`` uses,
all or none across tensor-parallel ranks as through ``vllm serve`` (``all_or_none``); and outputs
stamped with the policy version they were sampled under. ``AsyncLLM``: ``vllm_specrl.inprocess``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from vllm_specrl.sync.clients.engine_client import DEFAULT_CHUNK_BYTES, chunked

from vllm_specrl.sync.all_or_none import failure_after_rollback, first_refusal, needs_rollback


def _on_every_rank(llm: Any, method: str, *args: Any) -> dict:
    """The first refusal among the ranks' answers, else rank 0's."""
    return first_refusal(llm.collective_rpc(method, args=args))


def safetensors_chunks(tensors: dict, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """``tensors`` as safetensors bodies of about ``chunk_bytes``: bytes, not tensors, cross vLLM's RPC
    hops (an engine core in its own process receives a tensor argument as nested lists)."""
    from safetensors.torch import save

    for chunk, _ in chunked(tensors.items(), chunk_bytes):
        yield save({k: v.detach().cpu().contiguous() for k, v in chunk.items()})


def commit_update(llm: Any, target: str, tensors: dict, version: int, keep_mtp: bool = False) -> dict:
    """Stage ``tensors`` as ``target`` ("policy" or "draft") ``version``, validate, commit
    (``keep_mtp``: see ``EngineClient.update_policy``).

    Returns the worker's answer: ``ok`` False with the refusal (named problems) and nothing applied
    when validation fails; ``ok`` False with ``ranks_rolled_back`` when a rank failed while applying
    (every rank then serves the previous weights). The prefix cache is dropped after a policy commit
    (its KV is the old policy's) and after a failed one (some layers were new for a while), as the
    server's commit route does."""
    uid = uuid.uuid4().hex[:12]  # one id for every rank (each would draw its own)
    begun = _on_every_rank(llm, "specrl_begin_update", target, version, uid, keep_mtp)
    if not begun["ok"]:
        llm.collective_rpc("specrl_abort_update", args=(uid,))  # the ranks that began
        return begun
    staged = {"ok": True}
    for body in safetensors_chunks(tensors):
        staged = _on_every_rank(llm, "specrl_stage_bytes", uid, body)
        if not staged["ok"]:
            break
    ready = _on_every_rank(llm, "specrl_prepare_commit", uid) if staged["ok"] else staged
    if not ready["ok"]:
        llm.collective_rpc("specrl_abort_update", args=(uid,))
        return ready
    results = llm.collective_rpc("specrl_commit_update", args=(uid,))
    if all(r.get("ok") for r in results):
        llm.collective_rpc("specrl_finalize_commit", args=(uid,))
        if target == "policy":
            llm.reset_prefix_cache()
        return results[0]
    undone = llm.collective_rpc("specrl_rollback_commit", args=(uid,)) if needs_rollback(results) else None
    llm.reset_prefix_cache()
    return failure_after_rollback(results, undone)


def versions(llm: Any) -> dict[str, int]:
    """The versions the workers serve (rank 0's)."""
    return dict(llm.collective_rpc("specrl_sync_state")[0]["versions"])


def generate(llm: Any, *args: Any, **kwargs: Any) -> list:
    """``llm.generate``, each output stamped with ``policy_version`` (``LLM.generate`` runs to the end
    before anything else touches the engine, so one version holds for the whole call)."""
    version = versions(llm)["policy"]
    outputs = llm.generate(*args, **kwargs)
    for output in outputs:
        output.policy_version_start = output.policy_version = version
    return outputs
