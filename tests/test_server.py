"""``vllm_specrl.launcher``: ports that stay free until their user binds them; servers started side by side.

Engines: fake servers (a short Python script standing in for `vllm serve`): the launcher's own
handling is tested.
"""

import socket
import sys
import time

import pytest
import requests

from vllm_specrl.launcher import VLLMServer, ephemeral_port_range, free_port, started

# Stands in for ``vllm serve``: answers /health after a delay, or exits at once with an error.
FAKE_SERVE = """
import http.server, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # stop()'s SIGINT ends it, even if inherited ignored
time.sleep(float(sys.argv[2]))
if sys.argv[3] == "fail":
    sys.exit(3)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_free_ports_lie_below_the_kernels_ephemeral_range_and_are_free():
    """A port from ``bind(0)`` (the planted old way) lies inside the range the kernel hands out to the next
    ``bind(0)`` or connection, which is how a capture receiver found its port taken after an engine started."""
    low, high = ephemeral_port_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports), (ports, low)
    for p in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", p))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        assert low <= sock.getsockname()[1] <= high  # what the old free_port returned


def test_a_held_or_already_handed_out_port_is_skipped(monkeypatch):
    """The candidates come in as planted here: one another socket holds, then the one this process
    handed out last, then a free one; only the free one may come back."""
    import random

    given = free_port()
    with socket.socket() as held:
        for candidate in range(20000, 30000):
            try:
                held.bind(("127.0.0.1", candidate))
                break
            except OSError:
                continue
        free = next(p for p in range(candidate + 1, 30000) if p != given and _bindable(p))
        picks = iter([candidate, given, free])
        monkeypatch.setattr(random, "randrange", lambda low, high: next(picks))
        assert free_port() == free


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def fake_server(delay_s: float, mode: str = "serve") -> VLLMServer:
    server = VLLMServer("fake-model", startup_timeout_s=30)
    server.cmd = [sys.executable, "-c", FAKE_SERVE, str(server.port), str(delay_s), mode]
    return server


def test_servers_started_together_start_side_by_side_and_all_stop():
    """Two servers that each take 3 s to come up are both ready in well under the 6 s of one after the
    other, and both processes are gone after the block."""
    t0 = time.monotonic()
    with started(fake_server(3.0), fake_server(3.0)) as (a, b):
        ready_s = time.monotonic() - t0
        assert all(requests.get(s.url + "/health", timeout=5).status_code == 200 for s in (a, b))
    assert ready_s < 5.5, ready_s
    assert a.proc.poll() is not None and b.proc.poll() is not None


def test_a_server_that_fails_to_start_stops_the_others():
    healthy = fake_server(0.5)
    with pytest.raises(RuntimeError, match="exited with 3"):
        with started(fake_server(0.0, "fail"), healthy):
            pass
    assert healthy.proc.poll() is not None  # not left running


def test_wait_ready_before_launch_is_an_error():
    with pytest.raises(RuntimeError, match="before launch"):
        fake_server(0.0).wait_ready()
