"""What building capture frames beside a forward costs it, by where the building runs: no engine.

A stand-in for the worker's step on one CPU (``--layers`` matmuls of SmolLM2's width, each followed by
``--small-ops`` small torch ops: the Python between a real step's kernels), and one 16-request step's
capture frames built (``StepCapture.frames`` and ``encode_frame``, top-64) once per step on another CPU:

- ``none``: nothing beside the step;
- ``thread``: in a thread of the same process (the capture sender until the sender process), SCHED_IDLE
  with ``--idle``;
- ``process``: the same work in a separate process, at the same rate.

Reports the step's median and mean time per mode (rounds alternate the modes). Output: JSON.

    python scripts/bench/bench_sender_gil.py --out results/bench_sender_gil.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_capture import synthetic_step  # noqa: E402
from bench_engine import host_info  # noqa: E402

from vllm_specrl.capture.protocol import encode_frame  # noqa: E402
from vllm_specrl.capture.tap import collect_step  # noqa: E402


def step_view() -> dict:
    """A 16-request verify step of SmolLM2's shapes, 2 committed rows each, the sampler's log-softmax kept."""
    return synthetic_step(hidden=576, vocab=49152, batch=16, rows=2, raw_logprobs=True)


def build_frames(pending) -> None:
    for header, tensors in pending.frames():
        encode_frame(header, tensors)


def _sender_thread(jobs: queue.Queue, cpu: int, idle: bool) -> None:
    os.sched_setaffinity(0, {cpu})
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while (pending := jobs.get()) is not None:
        build_frames(pending)


def _sender_process(stop, cpu: int, period_s: float) -> None:
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    pending = collect_step(step_view(), topk=64, defer_scoring=True)
    while not stop.is_set():
        t0 = time.perf_counter()
        build_frames(pending)
        time.sleep(max(0.0, period_s - (time.perf_counter() - t0)))


def run_mode(mode: str, steps: int, layers: int, small_ops: int, forward_cpu: int, sender_cpu: int,
             idle: bool) -> list[float]:
    """Per-step times of the stand-in forward with ``mode`` beside it."""
    os.sched_setaffinity(0, {forward_cpu})
    weights = [torch.randn(576, 576) for _ in range(layers)]
    x = torch.randn(16, 576)

    def forward() -> None:
        y = x
        for w in weights:
            y = y @ w
            for _ in range(small_ops):
                y = y * 1.0001 + 0.0

    view = step_view()
    forward()
    t0 = time.perf_counter()
    for _ in range(20):
        forward()
    period_s = (time.perf_counter() - t0) / 20
    jobs: queue.Queue = queue.Queue()
    stop = None
    if mode == "thread":
        threading.Thread(target=_sender_thread, args=(jobs, sender_cpu, idle), daemon=True).start()
    elif mode == "process":
        ctx = multiprocessing.get_context("spawn")
        stop = ctx.Event()
        ctx.Process(target=_sender_process, args=(stop, sender_cpu, period_s), daemon=True).start()
        time.sleep(3.0)  # its imports
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        forward()
        if mode == "thread":
            jobs.put(collect_step(view, topk=64, defer_scoring=True))
        times.append(time.perf_counter() - t)
    jobs.put(None)
    if stop is not None:
        stop.set()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--small-ops", type=int, default=15)
    ap.add_argument("--idle", action="store_true", help="the sender thread at SCHED_IDLE")
    ap.add_argument("--out", type=Path, default=Path("results/bench_sender_gil.json"))
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs two CPUs: the forward's and the sender's")
    torch.set_num_threads(1)
    rows = []
    for r in range(args.rounds):
        for mode in ("none", "thread", "process"):
            times = run_mode(mode, args.steps, args.layers, args.small_ops, cpus[0], cpus[1], args.idle)[30:]
            rows.append({"round": r, "mode": mode, "median_ms": 1e3 * statistics.median(times),
                         "mean_ms": 1e3 * statistics.mean(times)})
            print(f"[sender-gil] round {r} {mode:>7}: median {rows[-1]['median_ms']:.2f} ms, "
                  f"mean {rows[-1]['mean_ms']:.2f} ms", flush=True)
    base = {r: next(x["mean_ms"] for x in rows if x["round"] == r and x["mode"] == "none") for r in range(args.rounds)}
    ratios = {m: [x["mean_ms"] / base[x["round"]] for x in rows if x["mode"] == m] for m in ("thread", "process")}
    report = {"benchmark": "sender_gil", "host": host_info(), "settings": {k: str(v) for k, v in vars(args).items()},
              "rows": rows, "mean_step_vs_none": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print("[sender-gil] mean step time against nothing beside it: "
          + ", ".join(f"{m} {' '.join(f'{v:.3f}' for v in r)}" for m, r in ratios.items()) + f"; wrote {args.out}")


if __name__ == "__main__":
    main()
