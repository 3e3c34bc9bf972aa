"""Weight updates for an in-process ``vllm.LLM`` (a colocated trainer, a test): the worker
extension's validated, atomic, versioned commit, without the HTTP routes ``EngineClient`` uses."""

from __future__ import annotations

from typing import Any


def _on_every_rank(llm: Any, method: str, *args: Any) -> dict:
    """The first refusal among the ranks' answers, else rank 0's."""
    answers = llm.collective_rpc(method, args=args)
    refused = [a for a in answers if not a.get("ok")]
    return refused[0] if refused else answers[0]


def commit_update(llm: Any, target: str, tensors: dict, version: int, keep_mtp: bool = False) -> dict:
    """Stage ``tensors`` as ``target`` ("policy" or "draft") ``version``, validate, commit
    (``keep_mtp``: see ``EngineClient.update_policy``).

    Returns the worker's answer: ``ok`` False with the refusal (named problems) and nothing applied
    when validation fails. A policy commit also drops the prefix cache (its KV is the old policy's),
    as the server's commit route does."""
    begun = _on_every_rank(llm, "specrl_begin_update", target, version, None, keep_mtp)
    if not begun["ok"]:
        return begun
    uid = begun["update_id"]
    staged = _on_every_rank(llm, "specrl_stage_tensors", uid, tensors)
    ready = _on_every_rank(llm, "specrl_prepare_commit", uid) if staged["ok"] else staged
    if not ready["ok"]:
        llm.collective_rpc("specrl_abort_update", args=(uid,))
        return ready
    done = _on_every_rank(llm, "specrl_commit_update", uid)
    llm.collective_rpc("specrl_finalize_commit", args=(uid,))
    if done["ok"] and target == "policy":
        llm.reset_prefix_cache()
    return done
