"""The online draft trainer publishing into an in-process engine, without HTTP.

``OnlineDraftTrainer`` talks to its engines through the calls of ``sync.clients.fleet.FleetClient`` (``statuses``,
``update_draft``, ``report_trainer``, ``active``, ``quarantined``). ``EngineTrainerClient`` answers them from
a ``SpecRLEngine`` in the same process: the trainer runs in a thread (``start_online_trainer``), and each
call runs on the engine's event loop, so a draft commit is the validated, all-or-none commit of
``SpecRLEngine.commit_update``.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_specrl.inprocess.engine import SpecRLEngine

NAME = "in-process"


class EngineTrainerClient:
    def __init__(self, engine: SpecRLEngine, loop: asyncio.AbstractEventLoop, timeout_s: float = 600.0):
        self.engine, self.loop, self.timeout_s = engine, loop, timeout_s
        self.quarantined: dict[str, str] = {}
        self.replicas = {NAME: engine}

    @property
    def active(self) -> dict[str, SpecRLEngine]:
        return {} if NAME in self.quarantined else dict(self.replicas)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def statuses(self) -> dict[str, tuple[bool, Any]]:
        try:
            return {NAME: (True, self._run(self.engine.status()))}
        except Exception as exc:  # noqa: BLE001 - the trainer counts an unreachable engine
            return {NAME: (False, repr(exc))}

    def update_draft(self, named_tensors: Any, version: int, pause: str = "none",
                     trainer_report: dict | None = None) -> dict:
        if trainer_report is not None:
            self.engine.trainer_report = trainer_report
        result = self._run(self.engine.commit_update("draft", dict(named_tensors), version, pause_mode=pause))
        failed = {} if result.get("ok") else {NAME: result.get("error") or "refused"}
        self.quarantined.update(failed)
        return {"target": "draft", "version": version, "committed": [] if failed else [NAME],
                "quarantined": failed, "replicas": {} if failed else {NAME: result}}

    def report_trainer(self, report: dict) -> dict[str, tuple[bool, Any]]:
        self.engine.trainer_report = report
        return {NAME: (True, {"ok": True})}


class OnlineTrainerThread:
    """An ``OnlineDraftTrainer`` in a thread of this process, publishing into ``engine``."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.thread: threading.Thread | None = None
        self.result: dict | None = None
        self.error: BaseException | None = None

    def stop(self, timeout_s: float = 120.0) -> dict | None:
        self.trainer.stop_requested.set()
        self.thread.join(timeout_s)
        if self.error is not None:
            raise self.error
        return self.result


def start_online_trainer(engine: SpecRLEngine, loop: asyncio.AbstractEventLoop, draft_dir: str | Path,
                         target_dir: str | Path, cfg: Any, train_cfg: Any = None,
                         checkpoint_dir: str | Path | None = None, log_path: str | Path | None = None
                         ) -> OnlineTrainerThread:
    """Train on the captured rows at ``cfg.capture`` (``trainer.online.OnlineConfig``; its ``engine`` URL
    is not used) and publish into ``engine``. ``loop``: the event loop the engine's calls run on."""
    from vllm_specrl.trainer.online import OnlineDraftTrainer

    trainer = OnlineDraftTrainer(draft_dir, target_dir, replace(cfg, engine=None), train_cfg, checkpoint_dir, log_path)
    trainer.client = EngineTrainerClient(engine, loop)
    handle = OnlineTrainerThread(trainer)

    def run() -> None:
        try:
            handle.result = trainer.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by stop()
            handle.error = exc
        finally:
            trainer.close()

    handle.thread = threading.Thread(target=run, name="specrl-online-trainer", daemon=True)
    handle.thread.start()
    return handle
