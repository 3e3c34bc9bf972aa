import pytest

from vllm_specrl import vllm_compat


@pytest.mark.parametrize("version,ok", [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.33.1", True), ("0.33.0rc1", True),
    ("0.31.9", False), ("0.34.0", False), ("1.32.0", False), ("dev", False),
])
def test_supported_range(version, ok):
    assert vllm_compat.is_supported(version) is ok


def test_check_supported_names_the_range():
    with pytest.raises(vllm_compat.UnsupportedVLLMVersion, match=r">=0.32,<0.34.*found 0.31.0"):
        vllm_compat.check_supported("0.31.0")
    assert vllm_compat.check_supported("0.32.0") == "0.32.0"


def test_installed_vllm_is_supported():
    assert vllm_compat.is_supported(vllm_compat.vllm_version())


class _Spec:
    method = "eagle3"
    model = "/ckpt/draft"
    num_speculative_tokens = 3
    draft_sample_method = "probabilistic"
    rejection_sample_method = "standard"


class _Cfg:
    speculative_config = _Spec()


def test_speculative_config_summary():
    summary = vllm_compat.speculative_config_summary(_Cfg())
    assert summary["method"] == "eagle3" and summary["num_speculative_tokens"] == 3
    assert vllm_compat.speculative_config_summary(object()) is None
