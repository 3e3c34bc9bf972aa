"""One weight update at a time, staged and validated in full before anything is applied.

An update is begun for a target (``policy`` or ``draft``) with the version it
will carry, receives tensors in any number of chunks (each checked on
arrival; a bad chunk poisons the update), and is committed only when every
tensor of the checkpoint has arrived exactly once. Until commit the model is
untouched, so any refusal leaves the old weights serving and the version
where it was. Pure bookkeeping: applying the weights is the caller's job.

Host memory: a staged tensor is either private to this rank (a copy) or a
read-only view of a shared-memory file that every rank of the host maps
(``shared``: one host copy for all of them). After a commit the applied set
stays as the rollback point of the next update (``last_good``) unless the
target's rollback point is turned off (``keep_last_good``), and the previous
set is held until every rank has applied (``finalize``). ``host_bytes`` says
what this rank holds.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import torch

from vllm_specrl.sync.worker.validate import ParamSpec, WeightUpdateError, missing_names, tensor_problems

TARGETS = ("policy", "draft")
# ``last_good`` of a target whose rollback point is off: there is nothing to go back to.
DROPPED = "dropped"
NO_ROLLBACK_HINT = ("no rollback point is kept for the policy (\"policy_rollback\": false): generation stays "
                    "paused; send the update again (a complete one commits and resumes), or restart from a "
                    "checkpoint")


def nbytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values()) if isinstance(tensors, dict) else 0


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
    shared_bytes: int = 0  # of bytes_received: views of a shared-memory file every rank of the host maps
    failed: str | None = None
    keep_mtp: bool = False  # a policy update without the MTP layers: the served ones stay

    def summary(self) -> dict:
        return {"update_id": self.update_id, "target": self.target, "version": self.version,
                "tensors_staged": len(self.staged), "tensors_expected": len(missing_names(set(), self.specs)),
                "bytes_received": self.bytes_received, "shared_bytes": self.shared_bytes,
                "age_s": round(time.time() - self.started, 3),
                "failed": self.failed, "keep_mtp": self.keep_mtp}


class UpdateStager:
    """The worker's update state machine: begin -> stage* -> commit | abort."""

    def __init__(self, keep_last_good: dict[str, bool] | None = None) -> None:
        self.session: UpdateSession | None = None
        # Whether a target's applied set is kept as the next update's rollback point (the draft always is).
        self.keep_last_good = {"policy": True, "draft": True, **(keep_last_good or {})}
        self.versions = {"policy": 0, "draft": 0}
        self.history: list[dict] = []
        # The whole tensor set of each target's last committed update (None: the served
        # checkpoint): what a failed apply restores. Updates are whole, so it is complete.
        # DROPPED once a commit of a target without a rollback point applied.
        self.last_good: dict[str, dict[str, torch.Tensor] | str | None] = {"policy": None, "draft": None}
        self.last_good_shared_bytes = {"policy": 0, "draft": 0}
        # Until every rank has applied: (update_id, target, version, tensors to go back to, their shared bytes).
        self.rollback_point: tuple[str, str, int, dict[str, torch.Tensor] | str | None, int] | None = None
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

    def stage(self, update_id: str, tensors: dict[str, torch.Tensor], owned: bool = False,
              shared: bool = False) -> dict:
        """Validate a chunk and keep its tensors: private copies, or as they are when ``owned`` (already
        private) or ``shared`` (read-only views of a shared-memory file, one host copy for all ranks)."""
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
            keep = (owned or shared) and tensor.device.type == "cpu"
            session.staged[name] = tensor.detach() if keep else tensor.detach().to("cpu", copy=True)
            size = tensor.numel() * tensor.element_size()
            session.bytes_received += size
            session.shared_bytes += size if shared and keep else 0
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
        self.rollback_point = (session.update_id, target, self.versions[target], self.last_good[target],
                               self.last_good_shared_bytes[target])
        self.versions[target] = session.version
        keep = self.keep_last_good[target]
        self.last_good[target] = session.staged if keep else DROPPED
        self.last_good_shared_bytes[target] = session.shared_bytes if keep else 0
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

    def rolled_back(self, update_id: str) -> tuple[str, int, dict[str, torch.Tensor] | str | None] | None:
        """Undo the bookkeeping of an applied ``update_id`` (another rank failed); returns what the
        caller must re-apply: ``(target, version, tensors, None for the checkpoint, or DROPPED)``."""
        if self.rollback_point is None or self.rollback_point[0] != update_id:
            return None
        _, target, version, tensors, shared = self.rollback_point
        self.rollback_point = None
        failed_version = self.versions[target]
        self.versions[target], self.last_good[target] = version, tensors
        self.last_good_shared_bytes[target] = shared
        self.last_failure = {"update_id": update_id, "target": target, "version": failed_version,
                             "failed": "rolled back: another rank failed to apply it", "restored": True,
                             "serving_version": version, "failed_at": time.time()}
        self.history = (self.history + [self.last_failure])[-20:]
        return target, version, tensors

    def host_bytes(self) -> dict:
        """Host memory this rank holds for weight sync, in bytes: ``private`` (this rank's own copies) and
        ``shared`` (views of shared-memory files: one copy per host, whatever the number of ranks)."""
        sets = [(nbytes(self.session.staged), self.session.shared_bytes) if self.session else (0, 0)]
        sets += [(nbytes(self.last_good[t]), self.last_good_shared_bytes[t]) for t in TARGETS]
        if self.rollback_point is not None:
            sets.append((nbytes(self.rollback_point[3]), self.rollback_point[4]))
        total, shared = sum(s[0] for s in sets), sum(s[1] for s in sets)
        return {"private": total - shared, "shared": shared, "total": total,
                "staging": sets[0][0], "last_good": {t: nbytes(self.last_good[t]) for t in TARGETS},
                "rollback_point": nbytes(self.rollback_point[3]) if self.rollback_point else 0,
                "keep_last_good": dict(self.keep_last_good)}

    def abort(self, update_id: str | None = None) -> dict | None:
        if self.session is None or (update_id and self.session.update_id != update_id):
            return None
        summary = self.session.summary()
        self.session = None
        return summary
