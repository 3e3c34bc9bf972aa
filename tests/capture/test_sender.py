"""The capture sender never blocks the engine's step; with ``send_timeout_s`` its thread waits
for a slow peer instead of dropping (what the offline warm start uses)."""

import time

import pytest
import torch

from vllm_specrl.capture.receiver import CaptureReceiver
from vllm_specrl.capture.sender import SEND_HWM, CaptureSender
from vllm_specrl.server import free_port

FRAMES = 10 * SEND_HWM  # 64 MB: more than the high-water marks and the kernel's socket buffers hold
ROWS = 16


def frame(i: int):
    """A prefill chunk of SmolLM2's shape (3 x 576 aux + 576 final, float32): 100 KB."""
    header = {"request_id": f"r{i}", "positions": list(range(ROWS)), "token_ids": [1] * ROWS,
              "next_token_ids": [2] * ROWS}
    return header, {"aux_hidden": torch.zeros(ROWS, 3 * 576), "final_hidden": torch.zeros(ROWS, 576)}


def offer_then_read_late(send_timeout_s: float) -> tuple[dict, int, float]:
    """Offer every frame at once; the receiver starts reading only 1.5 s later."""
    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = CaptureReceiver(address, rcv_hwm=SEND_HWM)
    sender = CaptureSender(address, queue_frames=FRAMES, send_timeout_s=send_timeout_s)
    try:
        t0 = time.perf_counter()
        assert all(sender.offer(*frame(i)) for i in range(FRAMES))
        offer_s = time.perf_counter() - t0
        time.sleep(1.5)
        received, deadline = 0, time.time() + 30
        while time.time() < deadline:
            received += len(receiver.receive(200))
            state = sender.state()
            if state["queued"] == 0 and state["frames_sent"] + state["frames_dropped_no_peer"] == FRAMES \
                    and not receiver.socket.poll(300):
                break
        return sender.state(), received, offer_s
    finally:
        sender.close()
        receiver.close()


def test_without_a_send_timeout_a_slow_peer_loses_frames():
    state, received, offer_s = offer_then_read_late(0.0)
    assert state["frames_dropped_no_peer"] > FRAMES // 2, state
    assert received == state["frames_sent"] < FRAMES
    assert offer_s < 1.0  # offering never waited


@pytest.mark.parametrize("send_timeout_s", [10.0])
def test_with_a_send_timeout_the_sender_thread_waits_and_nothing_is_lost(send_timeout_s):
    state, received, offer_s = offer_then_read_late(send_timeout_s)
    assert state["frames_dropped_no_peer"] == state["frames_dropped_queue_full"] == 0, state
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
