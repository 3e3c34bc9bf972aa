"""What the API-server processes of one `vllm serve` share: the record and the commit lock hold across
real processes (planted: without the flock, concurrent changes are lost), and two ``SpecRLHttpState``s
on one directory (two API servers) agree on versions, uploads, failures and the trainer's report."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest

from vllm_specrl import endpoints
from vllm_specrl import instance_state
from vllm_specrl.instance_state import ProcessLock, SharedRecord

INCREMENTS = 200


def _increment(path: str) -> None:
    record = SharedRecord(instance_state.Path(path), {"n": 0})
    for _ in range(INCREMENTS):
        with record.changing() as r:
            r["n"] += 1


def test_changes_from_several_processes_are_never_lost(tmp_path):
    path = tmp_path / "record.json"
    SharedRecord(path, {"n": 0})
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_increment, args=(str(path),)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert SharedRecord(path, {"n": 0}).read()["n"] == 3 * INCREMENTS


def test_a_fresh_record_forgets_what_a_dead_process_left(tmp_path):
    path = tmp_path / "record.json"
    with SharedRecord(path, {"versions": {"policy": 0}}).changing() as r:
        r["versions"]["policy"] = 7
    assert SharedRecord(path, {"versions": {"policy": 0}}).read()["versions"]["policy"] == 7
    assert SharedRecord(path, {"versions": {"policy": 0}}, fresh=True).read()["versions"]["policy"] == 0


def test_read_sees_another_writers_change(tmp_path):
    path = tmp_path / "record.json"
    a, b = SharedRecord(path, {"v": 0}), SharedRecord(path, {"v": 0})
    assert a.read()["v"] == 0
    with b.changing() as r:
        r["v"] = 3
    assert a.read()["v"] == 3


def _hold(path: str, held: multiprocessing.Event, release: multiprocessing.Event) -> None:
    async def go():
        async with ProcessLock(instance_state.Path(path)):
            held.set()
            release.wait(30)
    asyncio.run(go())


def test_the_commit_lock_excludes_another_process(tmp_path):
    path = tmp_path / "commit.lock"
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold, args=(str(path), held, release))
    proc.start()
    assert held.wait(60)

    async def try_lock():
        lock = ProcessLock(path)
        try:
            await asyncio.wait_for(lock.__aenter__(), 0.3)
        except asyncio.TimeoutError:
            return False
        await lock.__aexit__(None, None, None)
        return True

    assert asyncio.run(try_lock()) is False  # the other process holds it
    release.set()
    proc.join(30)
    assert asyncio.run(try_lock()) is True  # and a waiter cancelled meanwhile left nothing held


class FakeEngine:
    vllm_config = None

    def __init__(self):
        self.weight_versions = []

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True

    async def update_weight_version(self, version: str) -> None:
        self.weight_versions.append(version)


@pytest.fixture
def two_api_servers(tmp_path, monkeypatch):
    """Two API servers' states on one directory, as vLLM's multiprocess mode gives them."""
    monkeypatch.setenv(instance_state.MULTIPROC_ENV, str(tmp_path))
    directory = instance_state.instance_dir()
    return (endpoints.SpecRLHttpState(FakeEngine(), [], directory=directory),
            endpoints.SpecRLHttpState(FakeEngine(), [], directory=directory))


def test_a_commit_in_one_api_server_is_what_the_other_reports(two_api_servers):
    a, b = two_api_servers
    asyncio.run(a.committed({"target": "policy", "version": 3}, "keep"))
    assert b.versions == {"policy": 3, "draft": 0}
    asyncio.run(b.committed({"target": "draft", "version": 2}, "keep"))
    assert a.versions == {"policy": 3, "draft": 2}
    # the stale-draft guard's window starts at the policy change, whoever asks
    assert a.stale_draft()["version_lag"] == b.stale_draft()["version_lag"] == 1


def test_uploads_failures_and_reports_are_shared(two_api_servers):
    a, b = two_api_servers
    a.upload_opened("u1", "policy", 4)
    assert set(b.uploads) == {"u1"}
    b.upload_touched("u1", committing=True)
    assert a.uploads["u1"]["committing"] is True
    assert b.upload_closed("u1")["version"] == 4 and a.uploads == {}
    asyncio.run(a.commit_failed({"error": "boom", "rolled_back": True}))
    assert b.last_commit_failure["error"] == "boom"
    b.trainer_reported({"steps": 5})
    assert a.draft_trainer["steps"] == 5
    for i in range(endpoints.ABANDONED_KEPT + 2):
        a.upload_abandoned({"update_id": f"dead{i}"})
    assert len(b.abandoned_updates) == endpoints.ABANDONED_KEPT
    assert b.shared.read()["abandoned_updates_total"] == endpoints.ABANDONED_KEPT + 2


def test_the_version_header_reads_the_shared_record(two_api_servers):
    """What every completion's ``x-specrl-policy-version`` says, answered by either process."""
    from vllm_specrl.sync.http.routes import stamp_versions

    a, b = two_api_servers

    class Req:
        class url:
            path = "/v1/completions"

    class Resp:
        def __init__(self):
            self.headers = {}

    async def respond(_):
        await a.committed({"target": "policy", "version": 5}, "keep")
        return Resp()

    resp = asyncio.run(stamp_versions(Req(), respond, b))
    assert resp.headers["x-specrl-policy-version-start"] == "0"
    assert resp.headers["x-specrl-policy-version"] == "5"


def test_the_commit_lock_is_one_for_both(two_api_servers):
    a, b = two_api_servers
    order = []

    async def commit(state, name):
        async with state.commit_lock:
            order.append(f"{name} in")
            await asyncio.sleep(0.05)
            order.append(f"{name} out")

    async def both():
        await asyncio.gather(commit(a, "a"), commit(b, "b"))

    asyncio.run(both())
    assert order in (["a in", "a out", "b in", "b out"], ["b in", "b out", "a in", "a out"]), order
