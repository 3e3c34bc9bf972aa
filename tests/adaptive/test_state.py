"""The engine core -> API server channel for adaptive-k state: a file and a /metrics collector."""

import os

from prometheus_client import CollectorRegistry, generate_latest

from vllm_specrl.adaptive import state
from vllm_specrl.adaptive.controller import AdaptiveKController


def test_publish_read_and_metrics():
    pid = 10 ** 7 + os.getpid()  # not a real API server's pid
    ctl = AdaptiveKController(3, 8)
    for _ in range(5):
        ctl.record_choice(1, 2)
    ctl.record_choice(4, 0)
    try:
        assert state.read(pid) is None
        state.publish(ctl.state(), pid)
        got = state.read(pid)
        assert got["chosen_k_counts"] == [1, 0, 5, 0] and got["last_k"] == 0
        registry = CollectorRegistry()
        registry.register(state.prometheus_collector(pid))
        text = generate_latest(registry).decode()
        assert 'specrl_adaptive_k_steps_total{k="2"} 5.0' in text
        assert "specrl_adaptive_k 0.0" in text
        assert "specrl_adaptive_k_no_k_pays 0.0" in text and got["no_k_pays"] is False
    finally:
        state.state_path(pid).unlink(missing_ok=True)


def test_no_state_no_metrics():
    registry = CollectorRegistry()
    registry.register(state.prometheus_collector(10 ** 7 + 1 + os.getpid()))
    assert "specrl_adaptive_k" not in generate_latest(registry).decode()
