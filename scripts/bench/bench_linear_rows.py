"""What vLLM CPU's linear layers cost by the number of rows they multiply: is a verify pass's cost monotone in k?

A speculative step at B sequences and k drafts runs the target over B * (k + 1) rows. Adaptive k assumes a
step never costs less for verifying more rows; on some CPUs the bf16 kernels vLLM dispatches to disagree
(a step at 16 sequences and k = 1, 32 rows, measured slower than at k = 2, 48 rows). This times a model's
projections and LM head as vLLM's CPU dispatch runs them (``dispatch_cpu_unquantized_gemm``: the sgl
``weight_packed_linear`` kernel for small weights on AMX, oneDNN otherwise), at each row count, in rounds
that alternate the row counts, two ways:

- ``stack``: every layer with its own weights, in the model's order, then the LM head, as a forward runs
  them. At decode's row counts a forward streams every weight from memory once, so this is the figure a
  step pays; the medians per stack are ``all_layers_ms`` and ``lm_head_ms``.
- ``alone``: each projection called repeatedly on one weight (which then stays in the CPU's caches): what
  the kernel costs when memory is not the limit, per call (``layers``).

    python scripts/bench/bench_linear_rows.py --model .fixtures/real/target --rows 16,24,32,40,48,64 \\
        --out benchmarks/cpu/bench_linear_rows.json

vLLM alone (no plugin); random weights of the model's shapes, so no checkpoint is read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of a Llama-style layer's fused projections and the LM head, from an HF config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads)
    return {"qkv_proj": (hidden, (heads + 2 * kv) * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden),
            "lm_head": (hidden, config["vocab_size"])}


def vllm_linear(weight: torch.Tensor) -> tuple[str, torch.nn.Module]:
    """A module holding ``weight`` ([out, in]) with the ``cpu_linear`` vLLM's CPU dispatch gives it, and its kind."""
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel, dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.bias = None
    n, k = weight.shape
    kind = "sgl weight_packed_linear" if check_cpu_sgl_kernel(n, k, weight.dtype) else "oneDNN (or torch fallback)"
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return kind, layer


def time_rows(layer: torch.nn.Module, in_features: int, rows: list[int], dtype: torch.dtype, rounds: int,
              calls: int) -> dict[int, float]:
    """Median seconds per call at each row count, the row counts alternating within every round."""
    inputs = {m: torch.randn(m, in_features, dtype=dtype) for m in rows}
    for m in rows:  # first calls create the kernels for the shape
        for _ in range(3):
            layer.cpu_linear(inputs[m], layer.weight, None)
    samples: dict[int, list[float]] = {m: [] for m in rows}
    for _ in range(rounds):
        for m in rows:
            t0 = time.perf_counter()
            for _ in range(calls):
                layer.cpu_linear(inputs[m], layer.weight, None)
            samples[m].append((time.perf_counter() - t0) / calls)
    return {m: statistics.median(v) for m, v in samples.items()}


def layer_stack(config: dict, dtype: torch.dtype) -> list[tuple[str, int, torch.nn.Module]]:
    """Every layer's projections with their own random weights, in a forward's order: (name, in, module)."""
    shapes = projection_shapes(config)
    stack = []
    for _ in range(config["num_hidden_layers"]):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            fan_in, fan_out = shapes[name]
            stack.append((name, fan_in, vllm_linear(torch.randn(fan_out, fan_in, dtype=dtype) * 0.02)[1]))
    return stack


def time_stack(stack: list[tuple[str, int, torch.nn.Module]], head: torch.nn.Module, head_in: int,
               rows: list[int], dtype: torch.dtype, rounds: int) -> dict[int, tuple[float, float]]:
    """Median seconds of one pass over the stack, and of the LM head after it, at each row count."""
    widths = {fan_in for _, fan_in, _ in stack} | {head_in}
    inputs = {m: {w: torch.randn(m, w, dtype=dtype) for w in widths} for m in rows}

    def one_pass(m: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        for _, fan_in, layer in stack:
            layer.cpu_linear(inputs[m][fan_in], layer.weight, None)
        t1 = time.perf_counter()
        head.cpu_linear(inputs[m][head_in], head.weight, None)
        return t1 - t0, time.perf_counter() - t1

    for m in rows:  # first calls create the kernels for the shape
        one_pass(m)
    samples: dict[int, list[tuple[float, float]]] = {m: [] for m in rows}
    for _ in range(rounds):
        for m in rows:
            samples[m].append(one_pass(m))
    return {m: (statistics.median(s for s, _ in v), statistics.median(h for _, h in v)) for m, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="an HF model directory (its config.json is read)")
    ap.add_argument("--rows", default="16,24,32,40,48,64")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50, help="calls per timing (the LM head gets a tenth)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_linear_rows.json"))
    args = ap.parse_args()

    from vllm.platforms import current_platform

    from vllm_specrl.host import host_info

    current_platform.import_kernels()
    torch.manual_seed(0)
    dtype, rows = getattr(torch, args.dtype), [int(r) for r in args.rows.split(",")]
    config = json.loads((args.model / "config.json").read_text())
    shapes = projection_shapes(config)
    layers, modules, per_layer = {}, {}, {m: 0.0 for m in rows}
    for name, (fan_in, fan_out) in shapes.items():
        kind, modules[name] = vllm_linear(torch.randn(fan_out, fan_in, dtype=dtype) * 0.02)
        calls = max(args.calls // 10, 3) if name == "lm_head" else args.calls
        seconds = time_rows(modules[name], fan_in, rows, dtype, args.rounds, calls)
        layers[name] = {"in": fan_in, "out": fan_out, "kernel": kind,
                        "us_per_call": {str(m): round(1e6 * s, 1) for m, s in seconds.items()}}
        if name != "lm_head":
            for m in rows:
                per_layer[m] += seconds[m]
        print(f"{name:13} {kind:27} " + "  ".join(f"{m}:{1e6 * s:7.1f}us" for m, s in seconds.items()), flush=True)
    layer_count = config["num_hidden_layers"]
    alone = {str(m): round(1e3 * layer_count * s, 2) for m, s in per_layer.items()}
    print(f"{layer_count} x one layer's projections alone (cache-warm), ms by rows: "
          + "  ".join(f"{m}:{v}" for m, v in alone.items()))
    streamed = time_stack(layer_stack(config, dtype), modules["lm_head"], shapes["lm_head"][0], rows, dtype,
                          args.rounds)
    stack = {str(m): round(1e3 * s, 2) for m, (s, _) in streamed.items()}
    head_ms = {str(m): round(1e3 * h, 2) for m, (_, h) in streamed.items()}
    print(f"{layer_count} layers' projections, each its own weights (as a forward), ms by rows: "
          + "  ".join(f"{m}:{v}" for m, v in stack.items()))
    print("the LM head after them, ms by rows: " + "  ".join(f"{m}:{v}" for m, v in head_ms.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "linear_rows", "host": host_info(), "model": str(args.model),
                                    "settings": {"rows": rows, "dtype": args.dtype, "rounds": args.rounds,
                                                 "calls": args.calls},
                                    "layers": layers, "all_layers_ms": stack, "lm_head_ms": head_ms,
                                    "all_layers_alone_ms": alone}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
