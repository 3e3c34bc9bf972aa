"""The calibration sweep's plan: which batch sizes it runs, and how its requests are recognised: by the
deployment's secret, so a client that sets the sweep's prefix in its own request id is not taken for it.
The sweep against a served engine is in tests/adaptive/test_k_sweep_engine.py and tests/test_http.py."""

import pytest

from vllm_specrl.adaptive import calibration_ids
from vllm_specrl.adaptive.controller import AdaptiveKController
from vllm_specrl.adaptive.k_sweep import (bucket_label, calibration_batch_sizes, is_calibration_request,
                                          only_calibration)

TOKEN = "0f1e2d3c4b5a69788796a5b4"


@pytest.fixture(autouse=True)
def deployment_token(monkeypatch):
    monkeypatch.setenv(calibration_ids.TOKEN_ENV, TOKEN)
    monkeypatch.setattr(calibration_ids, "_marker", None)


@pytest.mark.parametrize("max_batch, sizes", [(16, [16, 15, 11, 7, 5, 3, 2, 1]), (12, [12, 11, 7, 5, 3, 2, 1]),
                                              (1, [1]), (3, [3, 2, 1]), (4, [4, 3, 2, 1])])
def test_one_batch_size_per_bucket_up_to_the_largest(max_batch, sizes):
    assert calibration_batch_sizes(max_batch) == sizes
    labels = AdaptiveKController(3, 256).state()["buckets"]
    assert len({bucket_label(labels, b) for b in sizes}) == len(sizes)  # one request per bucket


def test_the_engine_side_ids_of_a_sweep_request_are_recognised():
    # vLLM 0.32: "cmpl-<X-Request-Id>-<prompt index>", a "<sample>_" prefix for n > 1, a random suffix.
    sent = calibration_ids.request_id(TOKEN, 16, "1a2b3c4d")
    assert is_calibration_request(f"3_cmpl-{sent}-0-9f8e7d6c")
    assert not is_calibration_request("cmpl-5b0f0c8a6c2e4d3f-0-1a2b3c4d")


@pytest.mark.parametrize("forged", ["specrl-calibrate-16-1a2b3c4d",                   # the prefix alone
                                    "specrl-calibrate-deadbeef-16-1a2b3c4d",          # a guessed token
                                    f"specrl-calibrate-{TOKEN[:-1]}-16-1a2b3c4d"])    # nearly the token
def test_a_client_that_sets_the_prefix_itself_is_not_the_sweep(forged):
    assert not is_calibration_request(f"3_cmpl-{forged}-0-9f8e7d6c")
    assert not only_calibration([f"cmpl-{forged}-0-9f8e7d6c"])


def test_without_a_token_nothing_is_the_sweep(monkeypatch):
    monkeypatch.delenv(calibration_ids.TOKEN_ENV)
    assert not is_calibration_request(f"cmpl-{calibration_ids.request_id('', 16, 'x')}-0-y")


def test_the_plugin_makes_one_token_and_keeps_an_inherited_one(monkeypatch):
    monkeypatch.delenv(calibration_ids.TOKEN_ENV)
    made = calibration_ids.ensure_token()
    assert len(made) == 24 and calibration_ids.ensure_token() == made == calibration_ids.token()


def test_no_batch_no_sweep():
    with pytest.raises(ValueError):
        calibration_batch_sizes(0)


def test_a_step_is_a_calibration_step_only_when_every_request_is_the_sweeps():
    sweep = f"0_cmpl-{calibration_ids.request_id(TOKEN, 4, '0a1b2c3d')}-0-5e6f7a8b"
    assert only_calibration([sweep, sweep])
    assert not only_calibration([sweep, "cmpl-5b0f0c8a-0-1a2b3c4d"])
    assert not only_calibration([])  # an idle engine is not calibrating
