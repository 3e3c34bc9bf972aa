"""``vllm_specrl.server.free_port``: ports that stay free until their user binds them."""

import socket

from vllm_specrl.server import ephemeral_port_range, free_port


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
