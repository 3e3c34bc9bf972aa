"""The online trainer's client for an in-process engine: its calls run on the engine's event loop from the
trainer's thread, a refused draft is reported as not applied (the trainer counts it and retries), and the
trainer's report reaches the engine's status."""

from __future__ import annotations

import asyncio
import threading

from vllm_specrl.inprocess.trainer_client import NAME, EngineTrainerClient


class FakeEngine:
    def __init__(self, refuse: bool = False):
        self.refuse, self.loop_thread, self.trainer_report = refuse, None, None
        self.versions = {"policy": 3, "draft": 0}

    async def status(self):
        self.loop_thread = threading.current_thread().name
        return {"versions": dict(self.versions), "spec_decode": {}, "draft_trainer": self.trainer_report}

    async def commit_update(self, target, tensors, version, pause_mode="keep"):
        self.loop_thread = threading.current_thread().name
        if self.refuse:
            return {"ok": False, "error": "shape mismatch"}
        self.versions[target] = version
        return {"ok": True, "target": target, "version": version}


def _client(engine):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="engine-loop", daemon=True)
    thread.start()
    return EngineTrainerClient(engine, loop), loop


def test_calls_run_on_the_engines_loop_and_a_commit_moves_the_draft():
    engine = FakeEngine()
    client, loop = _client(engine)
    ok, status = client.statuses()[NAME]
    assert ok and status["versions"]["draft"] == 0 and engine.loop_thread == "engine-loop"
    result = client.update_draft({"w": 1}, version=1, trainer_report={"steps": 4})
    assert result["committed"] == [NAME] and not result["quarantined"] and engine.versions["draft"] == 1
    assert client.statuses()[NAME][1]["draft_trainer"] == {"steps": 4}
    loop.call_soon_threadsafe(loop.stop)


def test_a_refused_draft_is_reported_not_applied():
    client, loop = _client(FakeEngine(refuse=True))
    result = client.update_draft({"w": 1}, version=1)
    assert result["committed"] == [] and result["quarantined"] == {NAME: "shape mismatch"}
    assert client.active == {}
    client.quarantined.clear()   # what the trainer does before its next publish
    assert list(client.active) == [NAME]
    loop.call_soon_threadsafe(loop.stop)
