"""The capture sender never blocks the engine's step; with ``send_timeout_s`` its thread waits
for a slow peer instead of dropping (what the offline warm start uses); its thread runs off the
cores the worker's compute threads are bound to."""

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from vllm_specrl.capture.receiver import CaptureReceiver
from vllm_specrl.capture.sender import (SEND_HWM, CaptureSender, frames_settled, omp_bound_cpus, resolve_sender_cpus,
                                        spare_cpus)
from vllm_specrl.launcher import free_port

FRAMES = 10 * SEND_HWM  # 64 MB: more than the high-water marks and the kernel's socket buffers hold
ROWS = 16


def frame(i: int):
    """A prefill chunk of SmolLM2's shape (3 x 576 aux + 576 final, float32): 100 KB."""
    header = {"request_id": f"r{i}", "positions": list(range(ROWS)), "token_ids": [1] * ROWS,
              "next_token_ids": [2] * ROWS}
    return header, {"aux_hidden": torch.zeros(ROWS, 3 * 576), "final_hidden": torch.zeros(ROWS, 576)}


def offer_then_read_late(send_timeout_s: float, background: bool = False,
                         per_step: int = FRAMES) -> tuple[dict, int, float]:
    """Offer the frames, ``per_step`` at a time 20 ms apart (as an engine's steps come), to a connected
    receiver whose owner starts reading only 1.5 s after the last (with ``background``, the receiver's
    own thread takes frames meanwhile). Returns the sender's state, frames received, and the longest offer."""
    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = CaptureReceiver(address, rcv_hwm=SEND_HWM, background=background, max_buffered=FRAMES)
    sender = CaptureSender(address, queue_frames=FRAMES, send_timeout_s=send_timeout_s)
    try:
        assert wait_for_connected(sender, True) is True
        offer_s = 0.0
        for start in range(0, FRAMES, per_step):
            t0 = time.perf_counter()
            assert all(sender.offer(*frame(i)) for i in range(start, min(start + per_step, FRAMES)))
            offer_s = max(offer_s, time.perf_counter() - t0)
            time.sleep(0.02 if per_step < FRAMES else 0)
        time.sleep(1.5)
        received, deadline = 0, time.time() + 30
        while time.time() < deadline:
            received += len(receiver.receive(200))
            state = sender.state()
            if state["queued"] == 0 and frames_settled(state) == FRAMES and not receiver.pending(300):
                break
        return sender.state(), received, offer_s
    finally:
        sender.close()
        receiver.close()


def test_without_a_send_timeout_a_slow_peer_loses_frames():
    state, received, offer_s = offer_then_read_late(0.0)
    assert state["frames_dropped_peer_busy"] > FRAMES // 2, state
    assert state["frames_dropped_no_peer"] == 0, state  # connected, only behind
    assert received == state["frames_sent"] < FRAMES
    assert offer_s < 1.0  # offering never waited


def test_a_receiver_reading_in_the_background_loses_nothing_while_its_owner_is_busy():
    """The online trainer's receiver: its thread takes the frames while a training step runs (frames come
    16 a step, a step every 20 ms; 32 MB a second). Without the thread the same pace loses frames."""
    state, received, offer_s = offer_then_read_late(0.0, background=True, per_step=16)
    assert state["frames_dropped_peer_busy"] == state["frames_dropped_no_peer"] == 0, state
    assert received == state["frames_sent"] == FRAMES
    assert offer_s < 1.0


def test_a_full_background_buffer_stops_reading_and_the_sender_counts_the_drops():
    """Bounded memory: past ``max_buffered`` the receiver reads no more, so frames wait in ZeroMQ's
    queues and the sender drops and counts them as a peer behind; what was buffered is handed out."""
    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = CaptureReceiver(address, rcv_hwm=SEND_HWM, background=True, max_buffered=SEND_HWM)
    sender = CaptureSender(address, queue_frames=FRAMES)
    try:
        assert wait_for_connected(sender, True) is True
        assert all(sender.offer(*frame(i)) for i in range(FRAMES))
        deadline = time.time() + 30
        while time.time() < deadline and (sender.state()["queued"] or frames_settled(sender.state()) < FRAMES):
            time.sleep(0.1)
        state = sender.state()
        assert state["frames_dropped_peer_busy"] > FRAMES // 2, state
        with receiver._ready:
            assert len(receiver._buffer) == SEND_HWM
        received = len(receiver.receive(200, max_frames=FRAMES))
        assert received == SEND_HWM
    finally:
        sender.close()
        receiver.close()


def test_a_background_receivers_counters_move_only_when_frames_are_handed_out():
    """The online trainer reports ``counters`` with a publish and logs them after it: the thread's
    reading between the two must not make them disagree. What it read is counted at ``receive``."""
    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = CaptureReceiver(address, background=True)
    sender = CaptureSender(address)
    try:
        assert wait_for_connected(sender, True) is True
        assert sender.offer(*frame(0))
        assert len(receiver.receive(10_000)) == 1
        handed_out = dict(receiver.counters)
        assert handed_out["frames"] == 1 and handed_out["bytes"] > 0, handed_out
        assert all(sender.offer(*frame(i)) for i in range(1, 4))
        assert receiver.pending(10_000)  # the thread has read at least one more
        assert receiver.counters == handed_out
        got = []
        deadline = time.time() + 10
        while len(got) < 3 and time.time() < deadline:
            got += receiver.receive(200)
        assert len(got) == 3 and receiver.counters["frames"] == 4, receiver.counters
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("send_timeout_s", [10.0])
def test_with_a_send_timeout_the_sender_thread_waits_and_nothing_is_lost(send_timeout_s):
    state, received, offer_s = offer_then_read_late(send_timeout_s)
    assert state["frames_dropped_no_peer"] == state["frames_dropped_queue_full"] == 0, state
    assert state["frames_dropped_peer_busy"] == 0, state
    assert received == state["frames_sent"] == FRAMES
    assert offer_s < 1.0  # the engine's side still never waited: the queue absorbed the burst


def wait_for_connected(sender: CaptureSender, expected: bool, timeout_s: float = 10.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline and sender.state()["trainer_connected"] != expected:
        time.sleep(0.05)
    return sender.state()["trainer_connected"]


def test_trainer_connected_follows_the_connection_not_the_traffic():
    """A replica that is idle while its trainer lives reads connected (the fleet test read it after the
    other replica's request, and a 'sent recently' rule flaked there); a trainer that went away reads
    disconnected, with nothing sent either way."""
    address = f"tcp://127.0.0.1:{free_port()}"
    sender = CaptureSender(address)
    try:
        time.sleep(0.5)
        assert sender.state()["trainer_connected"] is False  # nobody listening yet
        receiver = CaptureReceiver(address)
        try:
            assert wait_for_connected(sender, True) is True
            time.sleep(0.5)
            assert sender.state()["trainer_connected"] is True
        finally:
            receiver.close()
        assert wait_for_connected(sender, False) is False
        assert sender.state()["frames_sent"] == 0
    finally:
        sender.close()


def _allowed_cpus(native_id: int) -> set[int]:
    """A thread's CPUs as the kernel reports them."""
    status = Path(f"/proc/self/task/{native_id}/status").read_text().splitlines()
    line = next(x for x in status if x.startswith("Cpus_allowed_list"))
    cpus = set()
    for part in line.split()[1].split(","):
        lo, _, hi = part.partition("-")
        cpus |= set(range(int(lo), int(hi or lo) + 1))
    return cpus


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_the_sender_thread_leaves_the_cores_the_worker_is_bound_to():
    """As vLLM's CPU worker does, a thread binds itself to one CPU and starts capture there: the sender's
    thread runs on the CPUs the parent process may use and the binding left out ("auto"), and frames
    still arrive; "inherit" keeps it beside the worker; anything else is refused with the choices."""
    mine = sorted(os.sched_getaffinity(0))
    out: dict = {}

    def bound_worker() -> None:
        os.sched_setaffinity(0, {mine[0]})  # this thread only, like the worker's OpenMP binding
        out["spare"] = resolve_sender_cpus("auto")
        out["inherit"] = resolve_sender_cpus("inherit")
        address = f"tcp://127.0.0.1:{free_port()}"
        receiver = CaptureReceiver(address)
        sender = CaptureSender(address, cpus=out["spare"])
        try:
            deadline = time.time() + 10
            while sender.state()["frames_sent"] == 0 and time.time() < deadline:
                sender.offer(*frame(0))
                time.sleep(0.05)
            out["received"] = len(receiver.receive(2000))
            out["sender_thread"] = _allowed_cpus(sender._thread.native_id)
            out["state"] = sender.state()
        finally:
            sender.close()
            receiver.close()

    worker = threading.Thread(target=bound_worker)
    worker.start()
    worker.join(30)
    parent = os.sched_getaffinity(os.getppid())
    assert out["spare"] == parent - {mine[0]} and out["spare"], out
    assert out["sender_thread"] == out["spare"] and out["state"]["sender_cpus"] == sorted(out["spare"]), out
    assert out["received"] >= 1 and out["inherit"] == set()
    with pytest.raises(ValueError, match="auto.*inherit"):
        resolve_sender_cpus([-1])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_cpus_bound_to_any_rank_are_not_spare(monkeypatch):
    """Under tensor or data parallelism on one host (``VLLM_CPU_OMP_THREADS_BIND="0|1"``), rank 1's worker
    sees CPU 0 outside its own binding, but rank 0's forward runs there: the sender stays off it (a
    sender process placed there at SCHED_IDLE starved and dropped steps while rank 0 computed)."""
    mine = sorted(os.sched_getaffinity(0))
    out: dict = {}

    def rank1_worker() -> None:
        os.sched_setaffinity(0, {mine[1]})
        out["unbound_mask"] = spare_cpus()
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{mine[0]}|{mine[1]}")
        out["two_ranks"] = spare_cpus()

    worker = threading.Thread(target=rank1_worker)
    worker.start()
    worker.join(30)
    parent = os.sched_getaffinity(os.getppid())
    assert out["unbound_mask"] == parent - {mine[1]}, out
    assert out["two_ranks"] == parent - {mine[0], mine[1]}, out
    assert omp_bound_cpus("0-3,8|4-7") == set(range(9)) and omp_bound_cpus("2|5") == {2, 5}
    assert omp_bound_cpus("auto") == omp_bound_cpus("nobind") == omp_bound_cpus("") == set()
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND"):
        omp_bound_cpus("0|x")


class Step:
    """A step's frames, built when the sender thread asks (``offer_step``); records which thread that was."""

    def __init__(self, first: int, count: int, fail: bool = False, gate: threading.Event | None = None):
        self.first, self.count, self.fail, self.gate = first, count, fail, gate
        self.built_in: int | None = None

    def __len__(self) -> int:
        return self.count

    def frames(self):
        if self.gate is not None:
            self.gate.wait(10)
        self.built_in = threading.get_ident()
        if self.fail:
            raise RuntimeError("planted")
        return [frame(self.first + i) for i in range(self.count)]


def test_a_steps_frames_are_built_in_the_sender_thread_counted_as_frames_and_a_bad_step_loses_only_itself():
    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = CaptureReceiver(address)
    sender = CaptureSender(address, queue_frames=7)
    gate = threading.Event()
    try:
        held = Step(0, 4, gate=gate)  # the sender thread is busy building this one until the gate opens
        assert sender.offer_step(held)
        time.sleep(0.3)
        assert sender.state()["queued"] == 4
        assert sender.offer(*frame(4))                     # 5 of 7
        assert not sender.offer_step(Step(5, 3))           # 8 > 7: refused whole, counted as 3 frames
        bad, good = Step(7, 1, fail=True), Step(8, 1)
        assert sender.offer_step(bad) and sender.offer_step(good)
        gate.set()
        ids, deadline = set(), time.time() + 10
        while len(ids) < 6 and time.time() < deadline:
            ids |= {h["request_id"] for h, _ in receiver.receive(200)}
        state = sender.state()
        while state["queued"] and time.time() < deadline:  # a frame arrives before its sender counts it sent
            time.sleep(0.05)
            state = sender.state()
        assert ids == {"r0", "r1", "r2", "r3", "r4", "r8"}, ids
        assert state["frames_offered"] == 10 and state["frames_dropped_queue_full"] == 3, state
        assert state["frames_dropped_build_error"] == 1 and "planted" in state["last_build_error"], state
        assert state["queued"] == 0 and state["frames_sent"] == 6, state
        assert held.built_in == good.built_in == sender._thread.ident != threading.get_ident()
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("idle", [True, False])
def test_an_idle_sender_thread_runs_at_sched_idle(idle):
    """``capture_sender_sched`` for the thread kind: the thread (and ZeroMQ's I/O thread it starts) at
    SCHED_IDLE, and the state says so; the offering thread keeps its own policy."""
    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = CaptureReceiver(address)
    sender = CaptureSender(address, idle=idle)
    try:
        deadline = time.time() + 10
        while not sender.state()["trainer_connected"] and time.time() < deadline:
            time.sleep(0.05)
        want = os.SCHED_IDLE if idle else os.SCHED_OTHER
        assert os.sched_getscheduler(sender._thread.native_id) == want
        assert sender.state()["sender_sched"] == ("idle" if idle else "normal")
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    finally:
        sender.close()
        receiver.close()
