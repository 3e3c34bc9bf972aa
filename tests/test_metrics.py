import prometheus_client
import pytest

from vllm_specrl import metrics

PROM_TEXT = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def test_summary_from_prometheus_text():
    s = metrics.from_prometheus_text(PROM_TEXT).summary()
    assert s["num_drafts"] == 10 and s["num_draft_tokens"] == 30
    assert s["acceptance_rate"] == pytest.approx(0.5)
    assert s["acceptance_length"] == pytest.approx(2.5)
    assert s["per_position_acceptance"] == pytest.approx([0.8, 0.5, 0.2])
    assert s["accepted_per_position"] == [8, 5, 2]


def test_summary_before_any_draft_has_no_ratios():
    s = metrics.SpecDecodeCounters().summary()
    assert s["acceptance_rate"] is None and s["acceptance_length"] is None
    assert s["per_position_acceptance"] == []


def test_minus_gives_the_phase_delta():
    before = metrics.from_prometheus_text(PROM_TEXT)
    after = metrics.from_prometheus_text(PROM_TEXT.replace(" 10.0", " 20.0").replace(" 15.0", " 25.0"))
    delta = after.minus(before).summary()
    assert delta["num_drafts"] == 10 and delta["num_accepted_tokens"] == 10
    assert delta["acceptance_length"] == pytest.approx(2.0)


def test_a_phase_delta_from_two_summaries():
    """What a client holds is two /specrl/status summaries; their delta must equal the counters' own,
    per position too (position 0's rate does not depend on how many drafts each step proposed)."""
    before = metrics.from_prometheus_text(PROM_TEXT)
    after = metrics.from_prometheus_text(
        PROM_TEXT.replace(" 10.0", " 20.0").replace(" 15.0", " 22.0").replace("\"0\"} 8.0", "\"0\"} 12.0")
        .replace("\"1\"} 5.0", "\"1\"} 7.0").replace("\"2\"} 2.0", "\"2\"} 3.0"))
    direct = after.minus(before).summary()
    via = metrics.summary_delta(before.summary(), after.summary())
    assert via == direct
    assert via["per_position_acceptance"] == pytest.approx([0.4, 0.2, 0.1])
    assert via["acceptance_length"] == pytest.approx(1.7)


def test_from_registry_sums_engines():
    reg = prometheus_client.CollectorRegistry()
    drafts = prometheus_client.Counter("vllm:spec_decode_num_drafts", "d", ["engine"], registry=reg)
    acc = prometheus_client.Counter("vllm:spec_decode_num_accepted_tokens", "a", ["engine"], registry=reg)
    pos = prometheus_client.Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "p",
                                    ["engine", "position"], registry=reg)
    for engine in ("0", "1"):
        drafts.labels(engine).inc(4)
        acc.labels(engine).inc(6)
        pos.labels(engine, "0").inc(3)
    s = metrics.from_prometheus_registry(reg).summary()
    assert s["num_drafts"] == 8 and s["acceptance_length"] == pytest.approx(2.5)
    assert s["per_position_acceptance"] == pytest.approx([0.75])
