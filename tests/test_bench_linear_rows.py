"""``scripts/bench/bench_linear_rows.py``: it times what vLLM's CPU dispatch runs for a model's projections,
so each timed call must compute the projection itself (x @ W.T) and the shapes must be the model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import load_script


def _bench():
    return load_script("scripts/bench/bench_linear_rows.py")


def test_shapes_are_the_models_fused_projections(tiny_model):
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    shapes = _bench().projection_shapes(config)
    hidden, head_dim = config["hidden_size"], config["hidden_size"] // config["num_attention_heads"]
    qkv_out = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    assert shapes == {"qkv_proj": (hidden, qkv_out), "o_proj": (hidden, hidden),
                      "gate_up_proj": (hidden, 2 * config["intermediate_size"]),
                      "down_proj": (config["intermediate_size"], hidden), "lm_head": (hidden, config["vocab_size"])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_timed_call_computes_the_projection(dtype):
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    bench = _bench()
    torch.manual_seed(0)
    weight = torch.randn(96, 64, dtype=dtype) * 0.1
    _, layer = bench.vllm_linear(weight.clone())
    x = torch.randn(24, 64, dtype=dtype)
    want = (x.float() @ weight.float().T)
    got = layer.cpu_linear(x, layer.weight, None).float()
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=0.05 if dtype == torch.bfloat16 else 1e-4, rtol=0.02), (got - want).abs().max()
    seconds = bench.time_rows(layer, 64, [8, 16], dtype, rounds=2, calls=2)
    assert set(seconds) == {8, 16} and all(s > 0 for s in seconds.values())
