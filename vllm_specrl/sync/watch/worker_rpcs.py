"""The weight watch's worker RPCs (mixed into ``SpecRLWorkerExtension``): what the engine core asks after
each call (``engine_core_events``) and tells back (a version, a label), and the draft checks."""

from __future__ import annotations

from typing import Any

from vllm_specrl.compat import engine_config
from vllm_specrl.sync.watch.worker_loads import publish_fingerprint, served_models, watch_of


class WeightWatchRPCs:
    """The watch's worker RPCs (mixed into ``SpecRLWorkerExtension``; the engine core calls them)."""

    def specrl_weight_watch_state(self) -> dict[str, Any]:
        return {**watch_of(self).state(), "versions": dict(self._specrl_stager().versions)}

    def specrl_note_weight_change(self, target: str, version: int, event: str) -> dict:
        """A load from outside completed: ``target`` serves ``version`` now (capture frames, the history
        proposer and the next update's version check read it)."""
        stager = self._specrl_stager()
        stager.versions[target] = max(int(version), stager.versions[target])
        self._specrl_tell_proposer()
        outcome = self._specrl_after_change(target, event)
        watch_of(self).note(event="version", target=target, version=stager.versions[target], path=event)
        return {"ok": True, "versions": dict(stager.versions), "drafter": outcome}

    def specrl_label_version(self, target: str, label: int | None, text: str) -> dict:
        """A version label (``finish_weight_update(weight_version)``, ``/update_weight_version``): an
        integer above the counted version names it; anything else is kept as the label alone."""
        stager, watch = self._specrl_stager(), watch_of(self)
        if label is not None and label > stager.versions[target]:
            stager.versions[target] = label
            self._specrl_tell_proposer()
            watch.note(event="labelled", target=target, version=label)
        elif label is None or label < stager.versions[target]:
            watch.note(event="label_kept_apart", target=target, label=text, version=stager.versions[target])
        return {"ok": True, "versions": dict(stager.versions)}

    def _specrl_after_change(self, target: str, event: str) -> dict | None:
        """The draft's fingerprint after a change of ``target``: a draft update (or, where the policy's own
        MTP layers draft, a policy update) publishes it; any other change must leave it as it was."""
        from vllm_specrl.lifecycle.worker import verify_draft

        if not served_models(self)["draft"]:
            return None
        if target == "draft" or self._specrl_drafts_with_mtp():
            publish_fingerprint(self)
            return {"action": "published"}
        return verify_draft(self, event)

    def _specrl_checkpoint_tensors(self, target: str) -> dict[str, Any]:
        """The served checkpoint's tensors of ``target`` (a draft served from the policy's MTP layers:
        those layers)."""
        from pathlib import Path

        from safetensors.torch import load_file

        directory = Path(engine_config.policy_checkpoint_dir(self) if target == "policy"
                         else engine_config.draft_checkpoint_dir(self))
        return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()
                if target == "policy" or not self._specrl_drafts_with_mtp() or engine_config.is_mtp_tensor(self, k)}

    def _specrl_draft_checkpoint(self) -> dict[str, Any]:
        return self._specrl_checkpoint_tensors("draft")
