"""What verifying k drafts costs the target's matrix multiplies on this CPU: one forward's projections
at 1, 2, 4 and 8 rows.

A verify pass runs the target on k + 1 tokens per sequence where plain decode runs one. On a GPU,
and on a CPU with AMX, a decode-sized multiply is bound by reading the weights, so a few more rows are
nearly free; where they are not, every verify pays. This runs the projections of all of SmolLM2-135M's
30 layers (q/k/v, o, gate/up, down; 106 M float32 weights, far beyond the caches) through vLLM's own
CPU GEMM path (``create_onednn_mm`` / ``onednn_mm``, what its linear layers dispatch to) with random
weights, in rounds that alternate the row counts, and writes ms per 30-layer pass.

    python scripts/bench/bench_gemm_rows.py --out results/bench_gemm_rows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench_engine import host_info

# SmolLM2-135M: hidden 576, 9 query / 3 key-value heads of 64, MLP 1536 (gate and up fused).
PROJECTIONS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def one_pass_ms(handlers, inputs, repeats: int) -> float:
    from vllm import _custom_ops as ops

    t0 = time.perf_counter()
    for _ in range(repeats):
        for layer in handlers:
            for name, handler in layer.items():
                ops.onednn_mm(handler, inputs[PROJECTIONS[name][1]], None)
    return 1e3 * (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, default=Path("results/bench_gemm_rows.json"))
    args = ap.parse_args()
    from vllm import _custom_ops as ops

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    handlers = [{name: ops.create_onednn_mm(torch.randn(n, k, dtype=dtype).t(), 32)
                 for name, (n, k) in PROJECTIONS.items()} for _ in range(LAYERS)]
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[int, list[float]] = {m: [] for m in rows}
    for _ in range(args.rounds):
        for m in rows:
            inputs = {k: torch.randn(m, k, dtype=dtype) for k in (576, 1536)}
            one_pass_ms(handlers, inputs, 2)  # warm-up at this shape
            times[m].append(one_pass_ms(handlers, inputs, args.repeats))
    base = statistics.median(times[rows[0]])
    table = {m: {"ms_median": round(statistics.median(t), 2), "ms_all": [round(x, 2) for x in t],
                 "vs_first": round(statistics.median(t) / base, 3)} for m, t in times.items()}
    for m, row in table.items():
        print(f"rows {m}: {row['ms_median']:.2f} ms per 30-layer pass ({row['vs_first']:.2f}x {rows[0]} row)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "gemm_rows", "host": host_info(), "dtype": args.dtype,
                                    "torch_threads": torch.get_num_threads(), "projections": PROJECTIONS,
                                    "layers": LAYERS, "rounds": args.rounds, "repeats": args.repeats,
                                    "rows": table}, indent=2))


if __name__ == "__main__":
    main()
