"""The capture sender in a process of its own, for a CPU engine: the worker's GIL stays the forward's.

A sender *thread* in the worker shares the worker's GIL: whenever it holds it (building frames, the
Python between its torch calls), the forward's thread waits to get it back between its own torch
calls, so a thread building frames slows the forward even on a core of its own, where the same
work in a separate process does not (``bench_sender_gil.py``, and ``bench_online_cost.py`` served).
So on a CPU engine the step hands its copied tensors to this process over a local ZeroMQ socket
(``capture.step_message``: a few calls per step, no copy), and the process scores the logit rows,
builds the per-request frames and sends them to the trainer with the thread sender
(``CaptureSender``), on the CPUs the worker leaves to its engine core.

Nothing waits on it: a step the socket cannot take (``transit_steps`` in flight; a sender that waits
for its peer, as many as frames queued) is dropped and counted, as a full queue is; a process that died leaves
capture dropping and counting, and ``state()`` says so (``sender_process``). Run as
``python -m vllm_specrl.capture.sender_process`` by ``SenderProcess`` only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from vllm_specrl.capture.sender import DEFAULT_QUEUE_FRAMES, CaptureSender, capture_address
from vllm_specrl.capture.step_message import StepMessageError, decode_step, encode_step
from vllm_specrl.processes import start_niced

TRANSIT_STEPS = 16  # steps on their way to the process before the worker drops one
STATE_EVERY_S = 0.1  # how often the process reports its counters


class SenderProcess:
    """Worker side: ``offer_step`` / ``state`` / ``close`` as ``CaptureSender``'s, the work elsewhere."""

    own_process = True  # scoring here takes nothing from the worker (``CaptureTap.scores_in_sender``)

    def __init__(self, address: str, queue_frames: int = DEFAULT_QUEUE_FRAMES, allow_remote: bool = False,
                 send_timeout_s: float = 0.0, cpus: set[int] | None = None, idle: bool = False,
                 transit_steps: int | None = None, start_timeout_s: float = 60.0):
        import zmq

        self.address = capture_address(address, allow_remote)
        self.cpus = sorted(cpus or ())
        self.idle = idle
        self.counters = {"frames_offered": 0, "frames_dropped_in_transit": 0}
        self._remote: dict[str, Any] = {}
        self._dir = tempfile.mkdtemp(prefix="specrl-capture-")  # 0700: the socket is this user's alone
        self.ipc = f"ipc://{self._dir}/steps"
        self._ctx = zmq.Context()
        for cpu in self.cpus:  # its I/O thread (it moves the step's bytes) off the forward's cores
            self._ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        self._sock = self._ctx.socket(zmq.PAIR)
        if transit_steps is None:  # a sender that waits for its peer wants every row: as many as frames queued
            transit_steps = queue_frames if send_timeout_s > 0 else TRANSIT_STEPS
        self._sock.setsockopt(zmq.SNDHWM, transit_steps)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.ipc)
        cmd = [sys.executable, "-m", "vllm_specrl.capture.sender_process", "--ipc", self.ipc, "--address", address,
               "--queue-frames", str(queue_frames), "--send-timeout-s", str(send_timeout_s),
               *(["--allow-remote"] if allow_remote else [])]
        self.proc = start_niced(cmd, niceness=0, idle=idle, cpus=set(self.cpus) or None,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        self._wait_started(start_timeout_s)

    def _wait_started(self, timeout_s: float) -> None:
        """Until the process reports (it is connected: no step is dropped for want of it), or raise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._sock.poll(100):
                self._read_states()
                return
        code = self.proc.poll()
        self.close(timeout_s=1.0)
        raise RuntimeError(f"the capture sender process did not start (exit code {code})")

    def offer_step(self, pending: Any) -> bool:
        """Hand a step's ``StepCapture`` over, or drop it (counted) when ``transit_steps`` are in flight."""
        import zmq

        self.counters["frames_offered"] += len(pending)
        self._read_states()
        try:
            self._sock.send_multipart(encode_step(pending), flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self.counters["frames_dropped_in_transit"] += len(pending)
            return False

    def _read_states(self) -> None:
        import zmq

        while not self._sock.closed:
            try:
                self._remote = json.loads(self._sock.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                return

    def state(self) -> dict[str, Any]:
        """``CaptureSender.state()``'s keys, the process's counters (up to ``STATE_EVERY_S`` old) with the
        worker's: offered here, dropped here or there."""
        self._read_states()
        remote = self._remote
        dropped_here = self.counters["frames_dropped_in_transit"]
        return {"address": self.address, "frames_sent": 0, "frames_dropped_no_peer": 0, "frames_dropped_peer_busy": 0,
                "frames_dropped_build_error": 0, "bytes_sent": 0, "queued": 0, "trainer_connected": False, **remote,
                "frames_offered": self.counters["frames_offered"],
                "frames_dropped_queue_full": remote.get("frames_dropped_queue_full", 0) + dropped_here,
                "sender_cpus": self.cpus, "sender_sched": "idle" if self.idle else "normal",
                "sender_process": {"pid": self.proc.pid, "exit_code": self.proc.poll()}}

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the process (it sends its last counters first), then the socket."""
        import zmq

        if self.proc.poll() is None:
            try:
                self._sock.send(b"", flags=zmq.NOBLOCK)  # after the steps in flight
            except zmq.Again:
                self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        time.sleep(0.05)
        self._read_states()
        self._sock.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """The process: steps in from the worker, frames out to the trainer, counters back every so often."""
    import torch
    import zmq

    ap = argparse.ArgumentParser(description="the capture sender process (started by SenderProcess)")
    ap.add_argument("--ipc", required=True)
    ap.add_argument("--address", required=True)
    ap.add_argument("--queue-frames", type=int, default=DEFAULT_QUEUE_FRAMES)
    ap.add_argument("--send-timeout-s", type=float, default=0.0)
    ap.add_argument("--allow-remote", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    parent = os.getppid()
    sender = CaptureSender(args.address, args.queue_frames, args.allow_remote, args.send_timeout_s)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(args.ipc)

    def report() -> None:
        try:
            sock.send(json.dumps(sender.state()).encode(), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    report()  # connected: the worker may send
    last = time.monotonic()
    try:
        while not stopping and os.getppid() == parent:  # a worker that died leaves this process
            if sock.poll(100):
                parts = sock.recv_multipart(copy=False)
                if len(parts) == 1 and not len(parts[0].buffer):
                    break
                try:
                    step = decode_step(parts)
                except StepMessageError as exc:
                    sender.counters["frames_dropped_build_error"] += 1
                    sender.last_build_error = str(exc)
                    continue
                sender.offer_step(step)
            if time.monotonic() - last >= STATE_EVERY_S:
                report()
                last = time.monotonic()
    finally:
        deadline = time.monotonic() + max(args.send_timeout_s, 0.0) + 1.0
        while sender.state()["queued"] and time.monotonic() < deadline:  # what is queued goes first
            time.sleep(0.01)
        sender.close()
        report()
        sock.close(linger=1000)
        ctx.term()


if __name__ == "__main__":
    main()
