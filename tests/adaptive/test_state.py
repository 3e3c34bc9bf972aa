"""The engine core -> API server channel for adaptive-k state: one file per engine core, read by every
API server, exported as gauges."""

from prometheus_client import REGISTRY, generate_latest

from vllm_specrl.adaptive import state
from vllm_specrl.adaptive.controller import AdaptiveKController


def controller(k_steps: int) -> AdaptiveKController:
    ctl = AdaptiveKController(3, 8)
    for _ in range(k_steps):
        ctl.record_choice(1, 2)
    ctl.record_choice(4, 0)
    return ctl


def test_publish_read_and_metrics(tmp_path):
    assert state.read(tmp_path) is None
    state.publish(controller(5).state(), state.state_path(tmp_path, 0))
    got = state.read(tmp_path)
    assert got["chosen_k_counts"] == [1, 0, 5, 0] and got["last_k"] == 0 and "data_parallel" not in got
    assert state.export_gauges(tmp_path) == 1
    text = generate_latest(REGISTRY).decode()
    assert 'specrl_adaptive_k_steps{engine="0",k="2"} 5.0' in text
    assert 'specrl_adaptive_k{engine="0"} 0.0' in text
    assert 'specrl_adaptive_k_no_k_pays{engine="0"} 0.0' in text and got["no_k_pays"] is False


def test_every_engine_core_is_read(tmp_path):
    """Data parallelism: two engine cores publish side by side; neither overwrites the other."""
    state.publish(controller(5).state(), state.state_path(tmp_path, 0))
    state.publish(controller(7).state(), state.state_path(tmp_path, 1))
    got = state.read(tmp_path)
    assert got["chosen_k_counts"][2] == 5
    assert got["data_parallel"]["1"]["chosen_k_counts"][2] == 7
    assert state.export_gauges(tmp_path) == 2
    assert 'specrl_adaptive_k_steps{engine="1",k="2"} 7.0' in generate_latest(REGISTRY).decode()
    state.remove(state.state_path(tmp_path, 1))
    assert "data_parallel" not in state.read(tmp_path)


def test_no_state_no_metrics(tmp_path):
    assert state.export_gauges(tmp_path / "none") == 0 and state.read(tmp_path / "none") is None
