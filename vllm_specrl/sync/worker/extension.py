"""Worker-side RPCs, installed with ``--worker-extension-cls vllm_specrl.sync.SpecRLWorkerExtension``.

vLLM appends this class to the worker's bases, so ``self`` is the worker and
every method is reachable through ``collective_rpc``. All names start with
``specrl_`` because vLLM asserts that an extension never shadows a worker
attribute, and its ``__init__`` is never called (state is created lazily).

Weight updates: ``specrl_begin_update`` -> ``specrl_stage_tensors`` /
``specrl_stage_file`` (any number of chunks) -> ``specrl_prepare_commit`` (every
rank complete and valid) -> ``specrl_commit_update`` -> ``specrl_finalize_commit``
(every rank applied) or ``specrl_rollback_commit`` (one did not); or
``specrl_abort_update``. A rank that fails while applying restores the last good
weights itself (the previous update's tensors, or the served checkpoint). RPCs
return ``{"ok": False, "error": ..., "problems": [...]}`` instead of raising, so
the reason survives every RPC hop intact.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from vllm_specrl import faults, plugin
from vllm_specrl.capture import runner_hooks
from vllm_specrl.compat import engine_config
from vllm_specrl.cpu import deferred_draft_kv as deferred_kv
from vllm_specrl.sync.worker import reload
from vllm_specrl._version import __version__
from vllm_specrl.sync.worker.staging import DROPPED, NO_ROLLBACK_HINT, UpdateBusy, UpdateStager
from vllm_specrl.sync.worker.validate import WeightUpdateError, checkpoint_specs
from vllm_specrl.sync.watch.worker_loads import own_load, watch_of
from vllm_specrl.lifecycle.worker import DrafterRPCs
from vllm_specrl.sync.watch.worker_rpcs import WeightWatchRPCs


# Top-K logprobs of the target sent with every sampled row: the online trainer's soft targets,
# taken from the engine's own logits of the policy version that produced the row (0 disables).
DEFAULT_CAPTURE_TOPK = 64


def host_memory() -> dict[str, int]:
    """This process's memory in bytes: resident, unique to it (``uss``) and its proportional share of
    pages it shares with others (``pss``: a shared-memory copy mapped by four ranks counts a quarter
    in each)."""
    import psutil

    info = psutil.Process().memory_full_info()
    return {"rss": info.rss, "uss": getattr(info, "uss", 0), "pss": getattr(info, "pss", 0),
            "shared": getattr(info, "shared", 0)}


def _refusal(exc: Exception) -> dict[str, Any]:
    return {"ok": False, "error": str(exc), "problems": getattr(exc, "problems", []),
            "busy": isinstance(exc, UpdateBusy)}


class SpecRLWorkerExtension(WeightWatchRPCs, DrafterRPCs):
    """Mixin for vLLM workers; see the module docstring."""

    def _specrl_stager(self) -> UpdateStager:
        stager = getattr(self, "_specrl_stager_obj", None)
        if stager is None:
            cfg = engine_config.specrl_additional_config(self.vllm_config)
            stager = self._specrl_stager_obj = UpdateStager(
                keep_last_good={"policy": bool(cfg.get("policy_rollback", True))})
        return stager

    def _specrl_specs(self, target: str, keep_mtp: bool = False) -> dict:
        """What an update of ``target`` must (and may) carry, from the served checkpoint's headers.
        ``keep_mtp``: the policy body alone (see ``specrl_begin_update``)."""
        cache = getattr(self, "_specrl_specs_cache", None)
        if cache is None:
            cache = self._specrl_specs_cache = {}
        if keep_mtp:
            if target != "policy" or not self._specrl_drafts_with_mtp():
                raise WeightUpdateError("keep_mtp is for policy updates of an engine that drafts with "
                                        "the policy's own MTP layers (\"method\": \"mtp\")")
            if "policy-body" not in cache:
                cache["policy-body"] = {name: spec for name, spec in self._specrl_specs("policy").items()
                                        if not engine_config.is_mtp_tensor(self, name)}
            return cache["policy-body"]
        if target not in cache:
            directory = (engine_config.policy_checkpoint_dir(self) if target == "policy"
                         else engine_config.draft_checkpoint_dir(self))
            if directory is None:
                raise WeightUpdateError("this engine serves no draft model to update "
                                        "(start it with an eagle3 or mtp --speculative-config)")
            specs = checkpoint_specs(directory)
            if target == "draft" and self._specrl_drafts_with_mtp():
                # The policy's own MTP layers: a draft update carries exactly those (an online
                # trainer's); a policy update carries them with the body.
                specs = {name: spec for name, spec in specs.items() if engine_config.is_mtp_tensor(self, name)}
            elif target == "policy" and not self._specrl_drafts_with_mtp():
                # A checkpoint's MTP layers that this engine does not draft with (plain serving of a
                # MiMo checkpoint): the loader drops them, so an update may send them or not.
                specs = {name: dataclasses.replace(spec, optional=engine_config.is_mtp_tensor(self, name))
                         for name, spec in specs.items()}
            cache[target] = specs
        return cache[target]

    def _specrl_drafts_with_mtp(self) -> bool:
        return engine_config.policy_mtp_drafter(self) is not None

    def specrl_status(self) -> dict[str, Any]:
        """What the plugin and the model look like from inside this worker process."""
        return {
            "pid": os.getpid(),
            "process": multiprocessing.current_process().name,
            "rank": getattr(self, "rank", None),
            "data_parallel_rank": engine_config.data_parallel_rank(self),
            "vllm_specrl": __version__,
            "plugin": plugin.state(),
            "sync": self.specrl_sync_state(),
            "weight_watch": watch_of(self).state(),
            "capture": self.specrl_capture_state(),
            "proposer": self.specrl_proposer_state(),
            "deferred_draft_kv": deferred_kv.deferred_draft_kv_counters(self),
            "host_memory": host_memory(),
            **engine_config.worker_model_summary(self),
        }

    def specrl_proposer_state(self) -> dict[str, Any] | None:
        """What a vllm-specrl proposer reports about itself (the history proposer's index), if one serves."""
        report = getattr(engine_config.runner_drafter(self), "specrl_status", None)
        return report() if callable(report) else None

    def specrl_sync_state(self) -> dict[str, Any]:
        stager = self._specrl_stager()
        return {"versions": dict(stager.versions), "host_bytes": stager.host_bytes(),
                "in_progress": stager.session.summary() if stager.session else None,
                "last_commits": stager.history[-3:], "last_failure": stager.last_failure}

    def specrl_begin_update(self, target: str, version: int, update_id: str | None = None,
                            keep_mtp: bool = False) -> dict:
        """``keep_mtp``: a policy update of the body alone on an engine that drafts with the policy's
        own MTP layers, which stay as they serve (an online trainer owns them, see ``update_draft``)."""
        try:
            plugin.require_active()  # no update without the watch the plugin installs
            specs = self._specrl_specs(target, bool(keep_mtp)) if target in ("policy", "draft") else {}
            session = self._specrl_stager().begin(target, version, specs, update_id, keep_mtp=bool(keep_mtp))
        except (WeightUpdateError, FileNotFoundError, plugin.PluginDeclined) as exc:
            return _refusal(exc)
        return {"ok": True, **session.summary()}

    def specrl_stage_tensors(self, update_id: str, tensors: dict, owned: bool = False, shared: bool = False) -> dict:
        try:
            return {"ok": True, **self._specrl_stager().stage(update_id, tensors, owned, shared)}
        except WeightUpdateError as exc:
            draft_names = self._specrl_draft_names() & set(tensors)
            if draft_names:
                exc.problems = [f"{p} (the draft's tensor: a policy update never reaches the drafter; send the "
                                "draft as a draft update)" if p.split(":")[0] in draft_names else p
                                for p in exc.problems]
            return _refusal(exc)

    def _specrl_draft_names(self) -> set[str]:
        """The served draft's own tensor names, when a policy update is open (empty otherwise)."""
        session = self._specrl_stager().session
        if session is None or session.target != "policy" or self._specrl_drafts_with_mtp():
            return set()
        try:
            return set(self._specrl_specs("draft")) - set(self._specrl_specs("policy"))
        except (WeightUpdateError, FileNotFoundError):
            return set()

    def _specrl_stage_parsed(self, update_id: str, parse: Any, refusal: Any, shared: bool = False) -> dict:
        """Parse a serialised chunk and stage it; an unreadable chunk ends the update."""
        try:
            tensors = parse()
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign chunk is a refusal
            self._specrl_stager().abort(update_id)
            return _refusal(WeightUpdateError(refusal(exc)))
        return self.specrl_stage_tensors(update_id, tensors, owned=True, shared=shared)

    def specrl_stage_file(self, update_id: str, path: str, shared: bool = False) -> dict:
        """Stage a safetensors file (the shared-memory transport writes one to /dev/shm). ``shared``: map
        it, so every rank of this host holds the one copy in shared memory; otherwise read a private copy
        (``"shared_staging": false``: /dev/shm is freed as soon as the writer deletes the file)."""
        from safetensors.torch import load

        from vllm_specrl.sync.shm import map_file

        return self._specrl_stage_parsed(
            update_id, lambda: map_file(path) if shared else load(Path(path).read_bytes()),
            lambda exc: f"cannot read update file {path} (not a complete safetensors chunk: {exc}); update aborted",
            shared=shared)

    def specrl_read_probe(self, path: str) -> dict:
        """The token of a shared-memory probe file, if this worker can read it (``EngineClient`` picks
        the shared-memory transport only when every worker does)."""
        from vllm_specrl.sync.shm import read_probe

        return {"ok": True, "token": read_probe(path)}

    def specrl_stage_bytes(self, update_id: str, body: bytes) -> dict:
        """Stage one safetensors-serialised chunk (the HTTP transport's bodies).

        Bytes, not tensors, cross the RPC hops: vLLM's executor message queue
        does not carry tensors through every path intact.
        """
        from safetensors.torch import load

        return self._specrl_stage_parsed(
            update_id, lambda: load(bytes(body)),
            lambda exc: f"update {update_id}: body is not a complete safetensors chunk ({len(body)} "
                        f"bytes: {exc}); update aborted, nothing applied")

    def specrl_prepare_commit(self, update_id: str) -> dict:
        """Phase one: this rank holds the whole update, validated (nothing applied)."""
        try:
            return {"ok": True, **self._specrl_stager().ready(update_id).summary()}
        except WeightUpdateError as exc:
            return _refusal(exc)

    def _specrl_apply(self, target: str, named: Any) -> None:
        with own_load(self):
            if target == "policy":
                reload.apply_policy_weights(self, named)
            else:
                reload.apply_draft_weights(self, named)

    def _specrl_restore(self, target: str, tensors: dict | str | None) -> str | None:
        """Re-apply a known good set (``None``: the served checkpoint's files); the error, if any
        (``DROPPED``: there is no set to go back to)."""
        if tensors == DROPPED:
            return NO_ROLLBACK_HINT
        try:
            with own_load(self):
                reload.end_interrupted_reload(self, target)
            if tensors is None:
                tensors = self._specrl_checkpoint_tensors(target)
            self._specrl_apply(target, sorted(tensors.items()))
            return None
        except Exception as exc:  # noqa: BLE001 - reported; the engine must say it is inconsistent
            return repr(exc)

    def specrl_commit_update(self, update_id: str) -> dict:
        """Phase two: apply. A failure part way restores the last good weights, keeps the version
        and closes the update; the answer says what happened."""
        stager = self._specrl_stager()
        try:
            session = stager.ready(update_id)
        except WeightUpdateError as exc:
            return _refusal(exc)
        t0 = time.perf_counter()
        named = sorted(session.staged.items())
        try:
            self._specrl_apply(session.target, faults.with_apply_fault(
                named, session.target, session.version, getattr(self, "rank", None),
                engine_config.data_parallel_rank(self)))
        except Exception as exc:  # noqa: BLE001 - whatever vLLM's loader raised, the old weights return
            target, serving = session.target, stager.versions[session.target]
            restore_error = self._specrl_restore(target, stager.last_good[target])
            record = stager.fail(session, repr(exc), restored=restore_error is None)
            no_rollback = stager.last_good[target] == DROPPED
            outcome = (f"restored {target} v{serving}" if restore_error is None else
                       f"{target} partly applied: {NO_ROLLBACK_HINT}" if no_rollback else
                       f"COULD NOT RESTORE {target} v{serving} ({restore_error}): restart the engine")
            return {"ok": False, "rolled_back": restore_error is None, "failure": record, "problems": [],
                    "no_rollback_point": no_rollback,
                    "error": f"{target} v{session.version} failed while applying ({exc!r}); {outcome}; "
                             f"version stays {serving}, update {update_id} closed"}
        finished = stager.finish(session, time.perf_counter() - t0)
        self._specrl_tell_proposer()
        if session.target == "policy" and not session.keep_mtp:
            self._specrl_keep_mtp_layers(session.staged)  # the policy's MTP layers came with it
        outcome = self._specrl_own_commit(session.target)
        return {"ok": True, **finished, "drafter": outcome}

    def _specrl_keep_mtp_layers(self, policy: dict) -> None:
        """Where the policy's own MTP layers draft, the MTP layers of the policy set now serving are the
        drafter's good set (what a repair restores)."""
        if self._specrl_drafts_with_mtp():
            self._specrl_stager().last_good["draft"] = {k: v for k, v in policy.items()
                                                        if engine_config.is_mtp_tensor(self, k)}

    def _specrl_own_commit(self, target: str) -> dict | None:
        """After the plugin's own commit (or rollback) of ``target``: its set is the known good one."""
        watch = watch_of(self)
        if target == "policy":
            watch.policy_restorable = True
        else:
            watch.draft_last_good = None  # the stager's last good set is the newer one
        return self._specrl_after_change(target, f"{target} update")

    def specrl_finalize_commit(self, update_id: str) -> dict:
        """Phase three: every rank applied; the previous weights are no longer needed."""
        return {"ok": True, "finalized": self._specrl_stager().finalize(update_id)}

    def _specrl_tell_proposer(self) -> None:
        """A proposer that keeps rollouts (history) learns the serving policy version, so older
        rollouts age (after a commit, and again after a rollback)."""
        on_policy = getattr(engine_config.runner_drafter(self), "on_policy_version", None)
        if callable(on_policy):
            on_policy(self._specrl_stager().versions["policy"])

    def specrl_rollback_commit(self, update_id: str) -> dict:
        """Another rank failed to apply ``update_id``: go back to what served before it."""
        undo = self._specrl_stager().rolled_back(update_id)
        if undo is None:
            return {"ok": True, "rolled_back": False}
        target, version, tensors = undo
        error = self._specrl_restore(target, tensors)
        if target == "policy" and isinstance(tensors, dict):
            self._specrl_keep_mtp_layers(tensors)
        self._specrl_tell_proposer()
        self._specrl_own_commit(target)
        return {"ok": error is None, "rolled_back": error is None, "target": target, "version": version,
                "no_rollback_point": tensors == DROPPED,
                **({"error": f"COULD NOT RESTORE {target} v{version} ({error}): restart the engine"}
                   if error else {})}

    def specrl_abort_update(self, update_id: str | None = None) -> dict:
        aborted = self._specrl_stager().abort(update_id)
        return {"ok": aborted is not None, "aborted": aborted}

    # -- capture ----------------------------------------------------------------------
    def specrl_capture_start(self, address: str | None = None, fraction: float | None = None,
                             queue_frames: int | None = None, allow_remote: bool | None = None) -> dict:
        """Stream committed rows' hidden states to ``address`` (defaults: ``--additional-config``)."""
        from vllm_specrl.capture.sender import (DEFAULT_QUEUE_FRAMES, CaptureSender, resolve_sender_cpus,
                                                resolve_sender_idle, resolve_sender_kind)
        from vllm_specrl.capture.sender_process import SenderProcess
        from vllm_specrl.capture.tap import CaptureTap

        try:
            plugin.require_active()
        except plugin.PluginDeclined as exc:
            return {"ok": False, "error": str(exc)}
        cfg = engine_config.specrl_additional_config(self.vllm_config)
        address = address or cfg.get("capture")
        if not address:
            return {"ok": False, "error": "no capture address (pass one, or set "
                    "--additional-config '{\"specrl\":{\"capture\":\"tcp://127.0.0.1:5557\"}}')"}
        if getattr(self, "rank", 0) not in (0, None):
            return {"ok": True, "rank": self.rank, "note": "capture sends from rank 0 only"}
        running = getattr(self, "_specrl_capture", None)
        if running is not None and getattr(self, "_specrl_capture_address", None) == address and fraction is None \
                and queue_frames is None and allow_remote is None:
            return {"ok": True, "tap": "running", "address": address, "fraction": running.fraction}
        self.specrl_capture_stop()
        try:
            send_timeout_s = float(cfg.get("capture_send_timeout_s", 0.0))
            cpus = resolve_sender_cpus(cfg.get("capture_sender_cpus", "auto"))
            kind = resolve_sender_kind(cfg.get("capture_sender", "auto"), cpus)
            frames = int(queue_frames or cfg.get("capture_queue_frames", DEFAULT_QUEUE_FRAMES))
            allow = bool(allow_remote if allow_remote is not None else cfg.get("capture_allow_remote", False))
            idle = resolve_sender_idle(cfg.get("capture_sender_sched", "auto"), cpus, send_timeout_s)
            sender_cls = SenderProcess if kind == "process" else CaptureSender
            sender = sender_cls(address, frames, allow, send_timeout_s=send_timeout_s, cpus=cpus, idle=idle)
        except (ValueError, RuntimeError) as exc:  # a bad setting, or a sender process that did not start
            return {"ok": False, "error": str(exc)}
        fraction = float(fraction if fraction is not None else cfg.get("capture_fraction", 1.0))
        stager = self._specrl_stager()
        import torch

        dtype = cfg.get("capture_dtype", "bfloat16")
        if dtype not in ("bfloat16", "float32"):
            return {"ok": False, "error": f"capture_dtype must be 'bfloat16' or 'float32', not {dtype!r}"}
        tap = CaptureTap(sender, fraction, lambda: stager.versions["policy"], dtype=getattr(torch, dtype),
                         topk=int(cfg.get("capture_topk", DEFAULT_CAPTURE_TOPK)))
        try:
            how = runner_hooks.install_capture_tap(self.model_runner, tap)
        except runner_hooks.CaptureUnavailable as exc:
            sender.close()
            return {"ok": False, "error": str(exc)}
        self._specrl_capture, self._specrl_capture_address = tap, address
        return {"ok": True, "tap": how, "address": address, "fraction": fraction}

    def specrl_capture_stop(self) -> dict:
        tap = getattr(self, "_specrl_capture", None)
        if tap is None:
            return {"ok": True, "stopped": False}
        runner_hooks.remove_capture_tap(self.model_runner)
        tap.sender.close()
        self._specrl_capture = None
        return {"ok": True, "stopped": True, "final": tap.sender.state()}

    def specrl_capture_state(self) -> dict | None:
        tap = getattr(self, "_specrl_capture", None)
        if tap is None:
            return None
        runner = self.model_runner
        tee = runner_hooks.speculator_tee(runner)
        errors = (tee.errors, tee.last_error) if tee is not None else (
            getattr(runner, "_specrl_capture_errors", 0), getattr(runner, "_specrl_capture_last_error", None))
        return {**tap.sender.state(), "fraction": tap.fraction, "steps": tap.steps,
                "steps_scored_by_sampler": tap.steps_scored_by_sampler,
                "steps_scored_by_sender": tap.steps_scored_by_sender,
                "tap_errors": errors[0], "last_tap_error": errors[1]}

    def specrl_record_drafts(self, enabled: bool = True, limit: int = 10_000) -> dict:
        """Start (or stop) recording what the drafter proposes: tokens and, with probabilistic
        drafting, the distributions vLLM verifies them against. For parity checks, not production."""
        records = self._specrl_draft_records = []

        def on_draft(batch: list[dict]) -> None:
            room = limit - len(records)
            records.extend(batch[:max(room, 0)])

        state = runner_hooks.install_draft_recorder(self.model_runner, on_draft if enabled else None)
        return {"ok": True, "recorder": state}

    def specrl_recorded_drafts(self) -> list[dict]:
        """The records since ``specrl_record_drafts`` (request id, base position, drafts, probs)."""
        return list(getattr(self, "_specrl_draft_records", []))
