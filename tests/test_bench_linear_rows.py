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
    assert torch.allclose(got, want, atol=0.05 if dtype == torch.bfloat16 else 1e-4,
                          rtol=0.02), (got - want).abs().max()
    seconds = bench.time_rows(layer, 64, [8, 16], dtype, rounds=2, calls=2)
    assert set(seconds) == {8, 16} and all(s > 0 for s in seconds.values())


def test_the_stack_streams_every_layers_own_weights_once_a_pass(tiny_model):
    """What a forward pays is every layer's weights read once; one weight reused would stay in cache."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    bench = _bench()
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    stack = bench.layer_stack(config, torch.float32)
    order = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] * config["num_hidden_layers"]
    assert [name for name, _, _ in stack] == order
    assert len({layer.weight.data_ptr() for _, _, layer in stack}) == len(stack)
    calls: list[tuple[int, int]] = []
    for index, (_, _, layer) in enumerate(stack):
        kernel = layer.cpu_linear

        def counted(x, weight, bias, _kernel=kernel, _index=index):
            calls.append((_index, x.shape[0]))
            return _kernel(x, weight, bias)
        layer.cpu_linear = counted
    shapes = bench.projection_shapes(config)
    _, head = bench.vllm_linear(torch.randn(shapes["lm_head"][1], shapes["lm_head"][0]))
    timed = bench.time_stack(stack, head, shapes["lm_head"][0], [4, 12], torch.float32, rounds=2)
    assert set(timed) == {4, 12} and all(s > 0 and h > 0 for s, h in timed.values())
    # one warm-up pass and two rounds at each row count, every layer once a pass, in the model's order
    assert [index for index, _ in calls] == list(range(len(stack))) * 6
    assert sorted({rows for _, rows in calls}) == [4, 12]
