"""The calibration sweep's plan: which batch sizes it runs, and how its requests are recognised.
The sweep against a served engine is in tests/test_http.py."""

import pytest

from vllm_specrl.adaptive.k_sweep import (bucket_label, calibration_batch_sizes, is_calibration_request,
                                            only_calibration)
from vllm_specrl.adaptive.controller import AdaptiveKController


@pytest.mark.parametrize("max_batch, sizes", [(16, [16, 15, 11, 7, 5, 3, 2, 1]), (12, [12, 11, 7, 5, 3, 2, 1]),
                                              (1, [1]), (3, [3, 2, 1]), (4, [4, 3, 2, 1])])
def test_one_batch_size_per_bucket_up_to_the_largest(max_batch, sizes):
    assert calibration_batch_sizes(max_batch) == sizes
    labels = AdaptiveKController(3, 256).state()["buckets"]
    assert len({bucket_label(labels, b) for b in sizes}) == len(sizes)  # one request per bucket


def test_the_engine_side_ids_of_a_sweep_request_are_recognised():
    # vLLM 0.32: "cmpl-<X-Request-Id>-<prompt index>", a "<sample>_" prefix for n > 1, a random suffix.
    assert is_calibration_request("3_cmpl-specrl-calibrate-16-1a2b3c4d-0-9f8e7d6c")
    assert not is_calibration_request("cmpl-5b0f0c8a6c2e4d3f-0-1a2b3c4d")


def test_no_batch_no_sweep():
    with pytest.raises(ValueError):
        calibration_batch_sizes(0)


def test_a_step_is_a_calibration_step_only_when_every_request_is_the_sweeps():
    sweep = "0_cmpl-specrl-calibrate-4-0a1b2c3d-0-5e6f7a8b"
    assert only_calibration([sweep, sweep])
    assert not only_calibration([sweep, "cmpl-5b0f0c8a-0-1a2b3c4d"])
    assert not only_calibration([])  # an idle engine is not calibrating
