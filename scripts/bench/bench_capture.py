"""Capture overhead: rollout throughput with capture on vs off, in the same server, same run.

Starts ``vllm serve`` with an EAGLE-3 draft, binds a receiver that drains and
decodes frames as the online trainer would (so capture runs against a live
peer), and alternates phases off/on ``--cycles`` times (to cancel drift) of
``--concurrency`` concurrent T=1 requests. Reports tokens/s per phase, the
on/off ratio, and the frames/s and bytes/s the receiver sustained while on.
Output: JSON.

    python scripts/bench/bench_capture.py --fixture real --draft results/drafts/real-warm
    python scripts/bench/bench_capture.py --fixture real --tap-only     # the worker's cost per step, no engine
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import requests

from bench_engine import completion_wave, host_info


def run_phase(srv, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    tokens, wall = completion_wave(srv.url, srv.model, prompts, max_tokens, concurrency=concurrency)
    return {"tokens": sum(tokens), "wall_s": wall, "tokens_per_s": sum(tokens) / wall}


def receiver_ceiling(hidden: int, aux_layers: int, rows: int, seconds: float) -> dict:
    """The most a trainer-side receiver takes in: a sender thread pushes synthetic frames of the
    model's shape (``rows`` committed rows each, bf16) as fast as it can; the receiver decodes and
    assembles them per request as the online trainer does. No engine: this is the ceiling."""
    import torch

    from vllm_specrl.capture.receiver import CaptureReceiver, SequenceAssembler
    from vllm_specrl.capture.sender import CaptureSender
    from vllm_specrl.launcher import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    rx = CaptureReceiver(address)
    tx = CaptureSender(address, queue_frames=64)
    tensors = {"aux_hidden": torch.randn(rows, aux_layers * hidden).to(torch.bfloat16),
               "final_hidden": torch.randn(rows, hidden).to(torch.bfloat16)}
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set():
            header = {"request_id": f"r{i % 64}", "positions": list(range(i // 64 * rows, (i // 64 + 1) * rows)),
                      "token_ids": [1] * rows, "next_token_ids": [2] * rows, "policy_version": 0, "step": i}
            if not tx.offer(header, tensors):
                time.sleep(0.0005)  # the queue is full: the engine would drop; here we just wait
            i += 1

    threading.Thread(target=produce, daemon=True).start()
    asm = SequenceAssembler()
    time.sleep(0.5)
    f0, b0, t0 = rx.counters["frames"], rx.counters["bytes"], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for header, tensors_ in rx.receive(50):
            asm.add(header, tensors_)
        if len(asm.requests) and sum(len(r.rows) for r in asm.requests.values()) > 20000:
            asm.requests.clear()
    wall = time.perf_counter() - t0
    stop.set()
    frames, nbytes = rx.counters["frames"] - f0, rx.counters["bytes"] - b0
    tx.close()
    rx.close()
    return {"rows_per_frame": rows, "hidden": hidden, "aux_layers": aux_layers, "seconds": wall,
            "frames_per_s": frames / wall, "rows_per_s": frames * rows / wall, "bytes_per_s": nbytes / wall,
            "rejected": rx.counters["rejected"]}


def synthetic_step(hidden: int, vocab: int, batch: int, rows: int, raw_logprobs: bool = False) -> dict:
    """A capture tap's view of a verify step (``runner_hooks.capture_step_view``): ``batch`` requests that
    each verified ``rows - 1`` drafts and committed all ``rows``; with ``raw_logprobs`` the sampler's
    log-softmax of the logits too, as the one-pass verify at T = 1 hands it over."""
    import torch

    n = batch * rows
    gen = torch.Generator().manual_seed(0)
    view = {"input_ids": torch.arange(n), "positions": torch.arange(n), "logits": torch.randn(n, vocab, generator=gen),
            "aux_hidden": [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for _ in range(3)],
            "final_hidden": torch.randn(n, hidden, generator=gen).to(torch.bfloat16),
            "requests": [{"request_id": f"r{i}", "start": i * rows, "end": (i + 1) * rows, "num_spec": rows - 1,
                          "sampled": [5] * rows, "logit_row": i * rows} for i in range(batch)]}
    if raw_logprobs:
        view["raw_logprobs"] = view["logits"].log_softmax(-1)
    return view


def tap_cost(hidden: int, vocab: int, batch: int, rows: int, topk: int, reps: int = 30) -> dict:
    """What building one engine step's capture frames costs the worker (``capture.tap``: hidden states
    copied, sampled-token logprobs and the top-k scored, frames assembled), on a synthetic step of
    ``batch`` requests that each verified ``rows - 1`` drafts and committed all ``rows``: all of it in
    the step (``ms_per_step``), or only the copies in the step (``ms_per_step_deferred``) and the rest
    in the sender thread (``sender_ms_per_step``), as a CPU engine whose sender runs on a core of its
    own does. One torch thread and glibc's raised malloc thresholds, as in the engine's worker. Median
    of ``reps`` steps."""
    import torch

    from vllm_specrl.cpu import malloc as cpu_malloc
    from vllm_specrl.capture.tap import collect_step

    cpu_malloc.tune_glibc_malloc()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    view = synthetic_step(hidden, vocab, batch, rows)

    def median_ms(fn) -> float:
        times = []
        for _ in range(reps + 3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times[3:])

    in_step = median_ms(lambda: collect_step(view, topk=topk).frames())
    deferred = median_ms(lambda: collect_step(view, topk=topk, defer_scoring=True))
    pending = collect_step(view, topk=topk, defer_scoring=True)
    sender = median_ms(pending.frames)
    torch.set_num_threads(threads)
    return {"batch": batch, "committed_rows_per_request": rows, "topk": topk, "vocab": vocab,
            "ms_per_step": in_step, "ms_per_step_deferred": deferred, "sender_ms_per_step": sender}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--fixture", default="real", choices=["real", "tiny"])
    ap.add_argument("--draft", type=Path, default=None, help="EAGLE-3 draft (default: a random one)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--sender-cpus", default="auto", choices=["auto", "inherit"],
                    help="capture_sender_cpus: the capture sender thread on the CPUs the worker's compute threads "
                         "are not bound to (auto), or beside them (inherit)")
    ap.add_argument("--topk", type=int, default=64,
                    help="capture_topk: the target's top-k logprobs per committed row, scored in the step "
                         "(make demo: 64)")
    ap.add_argument("--adaptive-k", action="store_true",
                    help="serve with adaptive k (vllm_specrl.adaptive), as make demo does: at 16 sequences it "
                         "learns k = 0, so the phases measure what capture costs the steps an RL loop's bulk takes")
    ap.add_argument("--out", type=Path, default=Path("results/bench_capture.json"))
    ap.add_argument("--ceiling-only", action="store_true",
                    help="only measure the receiver's ceiling (no engine; synthetic frames of the model's shape)")
    ap.add_argument("--ceiling-seconds", type=float, default=10.0)
    ap.add_argument("--tap-only", action="store_true",
                    help="only measure what building a step's frames costs the worker (no engine, no receiver)")
    args = ap.parse_args()

    from vllm_specrl.capture.receiver import CaptureReceiver, SequenceAssembler
    from vllm_specrl.fixtures import fixture_target
    from vllm_specrl.proposer.checkpoint import init_draft
    from vllm_specrl.launcher import VLLMServer, free_port

    model = Path(fixture_target(args.fixture, args.fixtures))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    if args.tap_only:
        cells = [tap_cost(config["hidden_size"], config["vocab_size"], b, r, k)
                 for b, r in ((1, 3), (4, 3), (8, 2), (16, 1), (16, 2), (16, 3)) for k in (0, 64)]
        for c in cells:
            print(f"[capture] tap: {c['batch']} requests x {c['committed_rows_per_request']} rows, top-{c['topk']}: "
                  f"{c['ms_per_step']:.2f} ms in the step; scored by the sender: {c['ms_per_step_deferred']:.2f} "
                  f"ms in the step, {c['sender_ms_per_step']:.2f} ms in the sender thread", flush=True)
        args.out.write_text(json.dumps({"benchmark": "capture_tap_cost", "model": str(model), "host": host_info(),
                                        "tap": cells}, indent=2))
        print(f"wrote {args.out}")
        return
    ceiling = [receiver_ceiling(config["hidden_size"], 3, rows, args.ceiling_seconds) for rows in (1, 4, 64)]
    for c in ceiling:
        print(f"[capture] receiver ceiling, {c['rows_per_frame']} rows/frame: {c['frames_per_s']:.0f} frames/s, "
              f"{c['rows_per_s']:.0f} rows/s, {c['bytes_per_s'] / 2**20:.0f} MiB/s", flush=True)
    if args.ceiling_only:
        args.out.write_text(json.dumps({"benchmark": "capture_receiver_ceiling", "model": str(model),
                                        "host": host_info(),
                                        "receiver_ceiling": ceiling}, indent=2))
        print(f"wrote {args.out}")
        return
    draft = args.draft
    if draft is None:
        draft = args.out.parent / "drafts" / f"{args.fixture}-capture-random"
        if not (draft / "config.json").exists():
            init_draft(model, draft, seed=0)
    address = f"tcp://127.0.0.1:{free_port()}"
    rx = CaptureReceiver(address)
    stop = threading.Event()
    received = {"frames": 0, "bytes": 0, "busy_s": 0.0}

    def drain() -> None:
        asm = SequenceAssembler()
        while not stop.is_set():
            t = time.perf_counter()
            frames = rx.receive(50)
            for header, tensors in frames:
                asm.add(header, tensors)
            if frames:
                received["busy_s"] += time.perf_counter() - t
            received["frames"], received["bytes"] = rx.counters["frames"], rx.counters["bytes"]
            if len(asm.requests) > 1000:
                asm.requests.clear()

    threading.Thread(target=drain, daemon=True).start()
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": args.k,
            "draft_sample_method": "probabilistic"}
    server_args = ["--dtype", args.dtype, "--max-model-len", "1024", "--max-num-seqs", str(args.concurrency),
                   "--speculative-config", json.dumps(spec)]
    server_args += ["--additional-config", json.dumps({"specrl": {"capture_sender_cpus": args.sender_cpus,
                                                                "capture_topk": args.topk}})]
    if args.adaptive_k:
        from vllm_specrl.adaptive import SCHEDULER_CLS

        server_args += ["--scheduler-cls", SCHEDULER_CLS]
    prompts = [f"Write a short story about a robot number {i}." for i in range(args.requests)]
    phases = []
    with VLLMServer(model, server_args, log_path=args.out.parent / "bench_capture_server.log") as srv:
        run_phase(srv, prompts[:4], 4, 8)  # warm-up
        for cycle in range(args.cycles):
            for enabled in (False, True):
                body = {"enabled": enabled, "address": address, "fraction": args.fraction}
                requests.post(srv.url + "/specrl/capture", json=body, timeout=60).raise_for_status()
                f0, b0 = received["frames"], received["bytes"]
                res = run_phase(srv, prompts, args.concurrency, args.max_tokens)
                time.sleep(1.0)  # let the receiver drain
                res.update(capture=enabled, cycle=cycle, frames=received["frames"] - f0,
                           bytes=received["bytes"] - b0)
                phases.append(res)
                print(f"[capture] cycle {cycle} capture={'on ' if enabled else 'off'}: "
                      f"{res['tokens_per_s']:.1f} tok/s, {res['frames']} frames", flush=True)
        status = requests.get(srv.url + "/specrl/status", timeout=60).json()
        state, adaptive = status.get("capture"), status.get("adaptive_k")
    stop.set()
    on = [p for p in phases if p["capture"]]
    off = [p for p in phases if not p["capture"]]
    ratio = statistics.mean(p["tokens_per_s"] for p in on) / statistics.mean(p["tokens_per_s"] for p in off)
    report = {"benchmark": "capture_overhead", "model": str(model), "draft": str(draft),
              "host": host_info(),
              "settings": vars(args) | {"out": str(args.out), "fixtures": str(args.fixtures),
                                        "draft": str(draft)},
              "phases": phases, "throughput_ratio_on_vs_off": ratio, "overhead": 1 - ratio,
              "receiver": {"frames_per_s": sum(p["frames"] for p in on) / sum(p["wall_s"] for p in on),
                           "bytes_per_s": sum(p["bytes"] for p in on) / sum(p["wall_s"] for p in on),
                           "decode_busy_fraction": received["busy_s"] / sum(p["wall_s"] for p in on),
                           "rejected": rx.counters["rejected"]},
              "engine_capture_state": state, "receiver_ceiling": ceiling,
              "chosen_k_counts": adaptive["chosen_k_counts"] if adaptive else None}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"[capture] on/off throughput ratio {ratio:.3f} (overhead {1 - ratio:.1%}); receiver "
          f"{report['receiver']['frames_per_s']:.0f} frames/s, "
          f"{report['receiver']['bytes_per_s'] / 2**20:.1f} MiB/s; wrote {args.out}")


if __name__ == "__main__":
    main()
