"""An in-process ``AsyncLLM`` with the guarantees ``vllm serve`` gives through the package's routes.

``SpecRLEngine(engine)`` wraps the engine a framework already built (with ``SpecRLWorkerExtension``, or a
``combined_extension`` of it and the framework's own):

- ``await commit_update(target, tensors, version)``: staged and validated on every rank, applied all or
  none inside a generation pause (vLLM's modes, ``keep`` by default: in-flight requests resume by
  recomputing their KV on the new weights), prefix cache reset after a policy commit, vLLM's weight
  version set; a refusal leaves the old weights serving. The same code as the HTTP commit
  (``sync.http.routes.commit_paused``). Updates are serialised: the policy trainer and the online draft
  trainer may both call it.
- ``generate(...)``: vLLM's outputs, each stamped with ``policy_version_start`` (at the request's
  arrival) and ``policy_version`` (now), as the HTTP headers ``x-specrl-policy-version*`` are.
- ``capture_start`` / ``status``: the worker RPCs, answered as one across ranks.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from vllm_specrl.sync.clients.llm import safetensors_chunks
from vllm_specrl.sync.http.routes import PAUSE_MODES, after_policy_commit, commit_paused, one_answer_from_every_rank


class SpecRLEngine:
    def __init__(self, engine: Any):
        self.engine = engine
        self.versions: dict[str, int] = {"policy": 0, "draft": 0}
        self._update_lock = asyncio.Lock()
        self.last_commit_failure: dict | None = None
        self.trainer_report: dict | None = None   # the in-process online trainer's (``trainer_client``)

    @property
    def engine_client(self) -> Any:
        return self.engine

    async def refresh_versions(self) -> dict[str, int]:
        """The versions the workers serve (after updates made around this object, e.g. vLLM's native API)."""
        state = await one_answer_from_every_rank(self.engine, "specrl_sync_state")
        self.versions.update(state["versions"])
        return dict(self.versions)

    async def commit_update(self, target: str, tensors: dict, version: int, pause_mode: str = "keep",
                            keep_mtp: bool = False) -> dict:
        """Stage, validate and apply ``tensors`` as ``target`` ("policy" or "draft") ``version``. The
        worker's answer: ``ok`` False with the refusal and nothing applied, or with ``ranks_rolled_back``
        when a rank failed while applying (every rank serves the previous weights again)."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, not {pause_mode!r}")
        async with self._update_lock:
            uid = uuid.uuid4().hex[:12]
            answer = await one_answer_from_every_rank(self.engine, "specrl_begin_update", target, version, uid,
                                                      keep_mtp)
            for body in safetensors_chunks(tensors) if answer.get("ok") else ():
                answer = await one_answer_from_every_rank(self.engine, "specrl_stage_bytes", uid, body)
                if not answer.get("ok"):
                    break
            if answer.get("ok"):
                answer = await commit_paused(self.engine, self, uid, pause_mode)
            if not answer.get("ok"):
                await self.engine.collective_rpc("specrl_abort_update", args=(uid,))
            return answer

    async def committed(self, result: dict, pause_mode: str) -> None:
        """Called inside the pause once every rank applied (``commit_paused``), as the server's state is."""
        if result["target"] == "policy":
            await after_policy_commit(self.engine, result, pause_mode)
        self.versions[result["target"]] = int(result["version"])

    async def commit_failed(self, result: dict) -> None:
        self.last_commit_failure = {k: result.get(k) for k in ("error", "rolled_back", "failure")}
        await self.engine.reset_prefix_cache(reset_running_requests=True)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """``AsyncLLM.generate``'s outputs, stamped with the policy versions they were sampled under."""
        start = self.versions["policy"]
        async for output in self.engine.generate(*args, **kwargs):
            output.policy_version_start = start
            output.policy_version = self.versions["policy"]
            yield output

    async def capture_start(self, address: str | None = None, **options: Any) -> dict:
        """Stream captured rows to ``address`` (default: the engine's ``capture`` setting)."""
        return await one_answer_from_every_rank(self.engine, "specrl_capture_start", address, *(
            options.get(k) for k in ("fraction", "queue_frames", "allow_remote")))

    async def status(self) -> dict:
        """Rank 0's worker status (versions, capture, weight watch, drafter) and vLLM's acceptance counters."""
        from vllm_specrl import metrics

        answer = await one_answer_from_every_rank(self.engine, "specrl_status")
        self.versions.update(answer["sync"]["versions"])
        return {**answer, "versions": dict(self.versions), "draft_trainer": self.trainer_report,
                "spec_decode": metrics.from_prometheus_registry().summary()}
