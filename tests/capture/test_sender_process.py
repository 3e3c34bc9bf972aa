"""The capture sender process: the frames a trainer receives are the ones the worker's step would have
built, the worker runs no Python thread for it beyond pyzmq's, its counters come back, and a process
that died leaves the step dropping and counting, never waiting."""

import os
import threading
import time

import pytest

from tests.capture.test_step_message import assert_same_frames, step_view
from vllm_specrl.capture.receiver import CaptureReceiver
from vllm_specrl.capture.sender import resolve_sender_idle, resolve_sender_kind
from vllm_specrl.capture.sender_process import SenderProcess
from vllm_specrl.capture.tap import collect_step
from vllm_specrl.launcher import free_port


def receive(receiver: CaptureReceiver, frames: int, timeout_s: float = 20.0) -> list:
    got, deadline = [], time.time() + timeout_s
    while len(got) < frames and time.time() < deadline:
        got += receiver.receive(200)
    return got


def settled_state(sender: SenderProcess, sent: int, timeout_s: float = 10.0) -> dict:
    """The state once the process has reported ``sent`` frames sent (it reports every 0.1 s)."""
    deadline = time.time() + timeout_s
    while (state := sender.state())["frames_sent"] < sent and time.time() < deadline:
        time.sleep(0.05)
    return state


@pytest.fixture()
def receiver():
    address = f"tcp://127.0.0.1:{free_port()}"
    rx = CaptureReceiver(address)
    rx.address = address
    yield rx
    rx.close()


def test_the_trainer_receives_the_frames_the_step_would_have_built(receiver):
    cpu = max(os.sched_getaffinity(0))
    threads_before = {t.ident for t in threading.enumerate()}
    sender = SenderProcess(receiver.address, cpus={cpu}, idle=True)
    try:
        view = step_view()
        want = []
        for _ in range(3):
            assert sender.offer_step(collect_step(view, topk=8, defer_scoring=True))
            want += collect_step(view, topk=8).frames()  # scored in the step, as without a sender process
        got = receive(receiver, len(want))
        envelope = ("magic", "version", "tensors")  # what the wire format adds to each header
        assert_same_frames([({k: v for k, v in h.items() if k not in envelope}, t) for h, t in got], want)
        state = settled_state(sender, len(want))
        assert state["frames_offered"] == state["frames_sent"] == len(want), state
        assert state["frames_dropped_queue_full"] == state["frames_dropped_build_error"] == 0, state
        assert state["trainer_connected"] and state["sender_sched"] == "idle" and state["sender_cpus"] == [cpu]
        assert os.sched_getscheduler(sender.proc.pid) == os.SCHED_IDLE
        assert os.sched_getaffinity(sender.proc.pid) == {cpu}
        # No Python thread of ours in the offering process: only pyzmq's collector of zero-copy buffers.
        new = [t for t in threading.enumerate() if t.ident not in threads_before]
        assert all(type(t).__module__ == "zmq.utils.garbage" for t in new), new
    finally:
        sender.close()
    final = sender.state()
    assert final["sender_process"]["exit_code"] == 0 and final["frames_sent"] == len(want), final


def test_a_sender_process_that_died_leaves_the_step_dropping_and_counting(receiver):
    sender = SenderProcess(receiver.address, transit_steps=2)
    try:
        sender.proc.kill()
        sender.proc.wait()
        capture = collect_step(step_view(), topk=8, defer_scoring=True)
        t0 = time.perf_counter()
        results = [sender.offer_step(capture) for _ in range(10)]
        assert time.perf_counter() - t0 < 5  # not a timing claim: a blocking send would never return
        assert not all(results) and results[-1] is False
        state = sender.state()
        assert state["frames_offered"] == 10 * len(capture), state
        assert state["frames_dropped_queue_full"] == results.count(False) * len(capture), state
        assert state["sender_process"]["exit_code"] is not None, state
    finally:
        sender.close()


def test_the_sender_kind_and_priority_settings():
    assert resolve_sender_kind("auto", {1}) == "process" and resolve_sender_kind("auto", set()) == "thread"
    assert resolve_sender_kind("thread", {1}) == "thread" and resolve_sender_kind("process", set()) == "process"
    assert resolve_sender_idle("auto", {1}, 0.0) and not resolve_sender_idle("auto", set(), 0.0)
    assert not resolve_sender_idle("auto", {1}, 5.0)  # the warm start waits for every row: its full share
    assert resolve_sender_idle("idle", set(), 5.0) and not resolve_sender_idle("normal", {1}, 0.0)
    for resolve, bad in ((lambda v: resolve_sender_kind(v, {1}), "fork"),
                         (lambda v: resolve_sender_idle(v, {1}, 0), "low")):
        with pytest.raises(ValueError):
            resolve(bad)


@pytest.mark.parametrize("send_timeout_s, want", [(0.0, 16), (5.0, 300)])
def test_a_sender_that_waits_for_its_peer_takes_as_many_steps_in_flight_as_frames_queued(receiver, send_timeout_s,
                                                                                          want):
    """The offline warm start wants every row; online capture drops past ``TRANSIT_STEPS``."""
    import zmq

    sender = SenderProcess(receiver.address, queue_frames=300, send_timeout_s=send_timeout_s)
    try:
        assert sender._sock.getsockopt(zmq.SNDHWM) == want
    finally:
        sender.close()
