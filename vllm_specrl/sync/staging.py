"""One weight update at a time, staged and validated in full before anything is applied.

An update is begun for a target (``policy`` or ``draft``) with the version it
will carry, receives tensors in any number of chunks (each checked on
arrival; a bad chunk poisons the update), and is committed only when every
tensor of the checkpoint has arrived exactly once. Until commit the model is
untouched, so any refusal leaves the old weights serving and the version
where it was. Pure bookkeeping: applying the weights is the caller's job.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import torch

from vllm_specrl.sync.validate import ParamSpec, WeightUpdateError, missing_names, tensor_problems

TARGETS = ("policy", "draft")


class UpdateBusy(WeightUpdateError):
    """Another update is open: a refusal that a later ``begin`` may not get (see the begin route)."""


@dataclass
class UpdateSession:
    update_id: str
    target: str
    version: int
    specs: dict[str, ParamSpec]
    started: float = field(default_factory=time.time)
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    bytes_received: int = 0
    failed: str | None = None
    keep_mtp: bool = False  # a policy update without the MTP layers: the served ones stay

    def summary(self) -> dict:
        return {"update_id": self.update_id, "target": self.target, "version": self.version,
                "tensors_staged": len(self.staged), "tensors_expected": len(missing_names(set(), self.specs)),
                "bytes_received": self.bytes_received, "age_s": round(time.time() - self.started, 3),
                "failed": self.failed, "keep_mtp": self.keep_mtp}


class UpdateStager:
    """The worker's update state machine: begin -> stage* -> commit | abort."""

    def __init__(self) -> None:
        self.session: UpdateSession | None = None
        self.versions = {"policy": 0, "draft": 0}
        self.history: list[dict] = []
        # The whole tensor set of each target's last committed update (None: the served
        # checkpoint): what a failed apply restores. Updates are whole, so it is complete.
        self.last_good: dict[str, dict[str, torch.Tensor] | None] = {"policy": None, "draft": None}
        # Until every rank has applied: (update_id, target, version and tensors to go back to).
        self.rollback_point: tuple[str, str, int, dict[str, torch.Tensor] | None] | None = None
        self.last_failure: dict | None = None

    def begin(self, target: str, version: int, specs: dict[str, ParamSpec],
              update_id: str | None = None, keep_mtp: bool = False) -> UpdateSession:
        if target not in TARGETS:
            raise WeightUpdateError(f"unknown update target {target!r}; use one of {TARGETS}")
        if self.session is not None:
            raise UpdateBusy(
                f"update {self.session.update_id} ({self.session.target} v{self.session.version}) "
                "is in progress; commit or abort it first")
        if not isinstance(version, int) or version <= self.versions[target]:
            raise WeightUpdateError(
                f"{target} version must be an integer above the current {self.versions[target]}; got {version!r}")
        self.session = UpdateSession(update_id or uuid.uuid4().hex[:12], target, version, specs,
                                     keep_mtp=keep_mtp)
        return self.session

    def current(self, update_id: str) -> UpdateSession:
        if self.session is None:
            raise WeightUpdateError(f"no update in progress (update {update_id} was never begun, "
                                    "or was already committed or aborted)")
        if self.session.update_id != update_id:
            raise WeightUpdateError(f"update {update_id} is not the one in progress "
                                    f"({self.session.update_id})")
        return self.session

    def stage(self, update_id: str, tensors: dict[str, torch.Tensor], owned: bool = False) -> dict:
        """Validate a chunk and keep private copies of its tensors (``owned``: already private)."""
        session = self.current(update_id)
        if session.failed:
            raise WeightUpdateError(f"update {update_id} already failed ({session.failed}); abort it")
        problems = []
        for name, tensor in tensors.items():
            if name in session.staged:
                problems.append(f"{name}: sent twice")
            else:
                problems.extend(tensor_problems(name, tensor, session.specs))
        if problems:
            session.failed = f"{len(problems)} bad tensors"
            raise WeightUpdateError(f"update {update_id} rejected, nothing applied", problems)
        for name, tensor in tensors.items():
            session.staged[name] = tensor.detach() if owned and tensor.device.type == "cpu" \
                else tensor.detach().to("cpu", copy=True)
            session.bytes_received += tensor.numel() * tensor.element_size()
        return session.summary()

    def ready(self, update_id: str) -> UpdateSession:
        """The session, if it is complete and clean; raises (and keeps it) otherwise."""
        session = self.current(update_id)
        if session.failed:
            raise WeightUpdateError(f"update {update_id} failed ({session.failed}); abort it")
        missing = missing_names(set(session.staged), session.specs)
        if missing:
            raise WeightUpdateError(
                f"update {update_id} is incomplete ({len(session.staged)} of "
                f"{len(session.staged) + len(missing)} tensors received; a truncated upload?), "
                "nothing applied", [f"{n}: missing" for n in missing])
        return session

    def finish(self, session: UpdateSession, seconds: float) -> dict:
        """Applied: the new version serves; the previous good set is kept until ``finalize``."""
        target = session.target
        self.rollback_point = (session.update_id, target, self.versions[target], self.last_good[target])
        self.versions[target] = session.version
        self.last_good[target] = session.staged
        record = dict(session.summary(), applied_s=round(seconds, 4), committed_at=time.time())
        self.history = (self.history + [record])[-20:]
        self.session = None
        return record

    def finalize(self, update_id: str) -> bool:
        """Every rank applied ``update_id``: nothing will roll it back, free the previous set."""
        if self.rollback_point is None or self.rollback_point[0] != update_id:
            return False
        self.rollback_point = None
        return True

    def fail(self, session: UpdateSession, error: str, restored: bool) -> dict:
        """Applying failed: the session is closed, the version stays, and status says so."""
        record = dict(session.summary(), failed=error, restored=restored, failed_at=time.time(),
                      serving_version=self.versions[session.target])
        self.last_failure = record
        self.history = (self.history + [record])[-20:]
        self.session = None
        return record

    def rolled_back(self, update_id: str) -> tuple[str, int, dict[str, torch.Tensor] | None] | None:
        """Undo the bookkeeping of an applied ``update_id`` (another rank failed); returns what the
        caller must re-apply: ``(target, version, tensors or None for the checkpoint)``."""
        if self.rollback_point is None or self.rollback_point[0] != update_id:
            return None
        _, target, version, tensors = self.rollback_point
        self.rollback_point = None
        failed_version = self.versions[target]
        self.versions[target], self.last_good[target] = version, tensors
        self.last_failure = {"update_id": update_id, "target": target, "version": failed_version,
                             "failed": "rolled back: another rank failed to apply it", "restored": True,
                             "serving_version": version, "failed_at": time.time()}
        self.history = (self.history + [self.last_failure])[-20:]
        return target, version, tensors

    def abort(self, update_id: str | None = None) -> dict | None:
        if self.session is None or (update_id and self.session.update_id != update_id):
            return None
        summary = self.session.summary()
        self.session = None
        return summary
