"""``all_finite``: the fast NaN/Inf check staging runs on every tensor of an update."""

import pytest
import torch

from vllm_specrl.sync.validate import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_finds_every_nan_and_inf(dtype):
    t = torch.randn(64, 33).to(dtype)
    assert all_finite(t)
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[17, 5] = bad
        assert not all_finite(u), (dtype, bad)


def test_finite_values_whose_sum_overflows_are_finite():
    big = torch.full((8,), 3.0e38, dtype=torch.bfloat16)
    assert not torch.isfinite(big.sum(dtype=torch.float32))  # the fast path cannot decide ...
    assert all_finite(big)  # ... so the exact check does
