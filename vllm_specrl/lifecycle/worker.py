"""Worker side of the drafter's lifecycle: the host copy of the draft that serves, and its repair.

The copy is taken when the drafter is loaded (the draft checkpoint's tensors, read into private host
memory: a hub id resolves to the snapshot vLLM downloaded; an MTP drafter's are the policy checkpoint's
MTP layers), and replaced by every intended draft update (a plugin commit, a validated native or
``load_weights`` draft load, a policy update carrying an MTP drafter's layers). Any other change of
the drafter (seen by its fingerprint) is dealt with as ``on_damage`` says: repaired from the copy
(vLLM's in-place reload, the path every draft update takes), reported, or refused (the engine core
stops drafting). A repair also drops what the drafter held from the damaged weights: the deferred
draft-KV stash here, the running requests' KV in the engine core (``engine_core``).
"""

from __future__ import annotations

import time
from typing import Any

from vllm_specrl._log import logger
from vllm_specrl.compat import engine_config
from vllm_specrl.lifecycle.config import DrafterConfig
from vllm_specrl.sync.worker.fingerprint import draft_fingerprint
from vllm_specrl.sync.watch.worker_loads import publish_fingerprint, served_models, watch_of


def drafter_config(worker: Any) -> DrafterConfig:
    config = getattr(worker, "_specrl_drafter_config", None)
    if config is None:
        config = worker._specrl_drafter_config = DrafterConfig.of(worker.vllm_config)
    return config


def read_draft_checkpoint(worker: Any) -> dict[str, Any]:
    """The served draft's tensors from its checkpoint, as private host copies (never a mapping of
    files a trainer may rewrite in place)."""
    return {name: tensor.clone() for name, tensor in worker._specrl_draft_checkpoint().items()}


def keep_loaded_draft(worker: Any) -> int:
    """At load: the draft just loaded becomes the good set a repair restores; its size in bytes."""
    from vllm_specrl.sync.worker.staging import nbytes

    stager = worker._specrl_stager()
    if not served_models(worker)["draft"] or isinstance(stager.last_good["draft"], dict):
        return 0
    try:
        stager.last_good["draft"] = read_draft_checkpoint(worker)
    except Exception as exc:  # noqa: BLE001 - no copy: repairs re-read the files, and say so if they cannot
        logger.warning("vllm-specrl: no host copy of the draft kept (%r): a damaged drafter is repaired from "
                       "its checkpoint files while they are readable", exc)
        return 0
    return nbytes(stager.last_good["draft"])


def good_draft(worker: Any) -> dict | str | None:
    """The last complete draft set loaded on purpose (None: the checkpoint's files)."""
    watch = watch_of(worker)
    return watch.draft_last_good if watch.draft_last_good is not None else worker._specrl_stager().last_good["draft"]


def drop_draft_caches(worker: Any) -> int:
    """Forget the deferred draft-KV rows (passes not yet run); the rows dropped."""
    deferral = getattr(engine_config.runner_drafter(worker), "_specrl_deferred_kv", None)
    if deferral is None:
        return 0
    return deferral.stash.clear()


def verify_draft(worker: Any, event: str, force: bool = False) -> dict:
    """After ``event``: is the drafter the one published? If not (or ``force``: the collapse alarm's one
    try), act as ``on_damage`` says. The outcome: ``action`` none | repaired | repair_failed | reported |
    refused, with the fingerprints."""
    if not served_models(worker)["draft"]:
        return {"action": "none", "draft": False}
    watch = watch_of(worker)
    if watch.session is not None:  # a native session or reload is loading: half-loaded is not damage
        return {"action": "none", "session_open": watch.session_kind}
    if watch.published_fingerprint is None:
        publish_fingerprint(worker)
        return {"action": "none"}
    found = draft_fingerprint(worker)
    if found == watch.published_fingerprint and not force:
        return {"action": "none"}
    mode = drafter_config(worker).on_damage
    damage = {"after": event, "expected": watch.published_fingerprint, "found": found, "time": round(time.time(), 3),
              "forced": force and found == watch.published_fingerprint}
    if mode != "repair":
        if watch.mismatch is None:
            watch.mismatch = damage
            logger.warning("vllm-specrl: the draft's weights changed without a draft update (after %s); "
                           "on_damage=%s: %s", event, mode, "drafting stops until a draft update arrives"
                           if mode == "refuse" else "reported only (publish a draft to clear it)")
        if mode == "refuse":
            watch.refusing = damage
        return {"action": "refused" if mode == "refuse" else "reported", **damage}
    t0 = time.perf_counter()
    error = worker._specrl_restore("draft", good_draft(worker))
    after = draft_fingerprint(worker)
    ok = error is None and after == watch.published_fingerprint
    dropped = drop_draft_caches(worker)
    record = {**damage, "repaired": ok, "error": error, "seconds": round(time.perf_counter() - t0, 3),
              "stash_rows_dropped": dropped, **({} if ok else {"after_repair": after})}
    cause = event.split("(")[0]
    watch.repairs[cause] = watch.repairs.get(cause, 0) + 1
    watch.last_repair = record
    watch.note(event="draft_repaired" if ok else "draft_repair_failed", after=event)
    if ok:
        watch.mismatch = None
        logger.warning("vllm-specrl: the drafter changed without a draft update (after %s): repaired from the "
                       "host copy in %.3f s", event, record["seconds"])
    else:
        watch.mismatch = damage
        logger.error("vllm-specrl: the drafter changed without a draft update (after %s) and the repair failed "
                     "(%s): publish a draft, or restart the engine", event, error or "fingerprint differs")
    return {"action": "repaired" if ok else "repair_failed", **record}


class DrafterRPCs:
    """The lifecycle's worker RPCs (mixed into ``SpecRLWorkerExtension``; the engine core calls them)."""

    def specrl_verify_draft(self, event: str, force: bool = False) -> dict:
        return {"ok": True, "drafter": verify_draft(self, event, force)}

    def specrl_draft_updated(self) -> None:
        """A draft update arrived: refusal ends (the engine core resumes drafting)."""
        watch_of(self).refusing = None
