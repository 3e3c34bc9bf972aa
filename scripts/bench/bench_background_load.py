"""What a background process on the engine's cores (the online draft trainer) costs vLLM's generation,
by where it may run.

Each cell starts ``vllm serve`` (the demo's settings: bf16, EAGLE-3 k = 3 with adaptive k, or
plain), optionally a trainer-like process (one torch thread multiplying matrices, nice 19 and
SCHED_IDLE, as ``rl_demo.py`` starts the draft trainer), free to run on any core (``+bg``) or pinned
to the last core, which vLLM's CPU worker leaves to its engine core (``+bgpin``), sends
``--concurrency`` seeded T = 1 requests of ``--max-tokens`` tokens in ``--waves`` waves, and records
tokens per second and, for an adaptive engine, the controller's mean time per step outside the model
runner. Cells run in turn, ``--rounds`` times; each cell is compared with the round's first cell.
Output: JSON.

    python scripts/bench/bench_background_load.py --fixtures .fixtures --draft .fixtures/real/drafts/demo-explain
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import requests

from bench_engine import completion_wave, host_info

HOG = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\n"
       "while True:\n    (a @ a).sum()\n")


def run_wave(srv, concurrency: int, max_tokens: int, seed: int) -> tuple[int, float]:
    prompts = [f"Explain step by step how to add {i} and {i + 7}." for i in range(concurrency)]
    tokens, seconds = completion_wave(srv.url, srv.model, prompts, max_tokens,
                                      seeds=[seed + i for i in range(concurrency)])
    return sum(tokens), seconds


def run_cell(model: Path, draft: Path | None, background: str, args) -> dict:
    from vllm_specrl.processes import start_niced
    from vllm_specrl.launcher import VLLMServer

    server_args = ["--dtype", args.dtype, "--max-model-len", "1024", "--seed", "0"]
    if draft is not None:
        spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3,
                "draft_sample_method": "probabilistic"}
        server_args += ["--speculative-config", json.dumps(spec),
                        "--scheduler-cls", "vllm_specrl.adaptive.scheduler.AdaptiveKScheduler"]
    hog = None
    with VLLMServer(model, server_args, log_path=args.out.parent / "bench_background_load_server.log") as srv:
        run_wave(srv, args.concurrency, args.warm_up_tokens, 10_000)  # warm-up (and adaptive k's first buckets)
        if background:
            hog = start_niced([sys.executable, "-c", HOG], 19, idle=True)
            if background == "bgpin":  # to the last core: vLLM's CPU worker binds to the first ones
                os.sched_setaffinity(hog.pid, {max(os.sched_getaffinity(0))})
        try:
            time.sleep(1.0)
            before = requests.get(srv.url + "/specrl/status", timeout=30).json().get("adaptive_k")
            waves = [run_wave(srv, args.concurrency, args.max_tokens, 100 * w) for w in range(args.waves)]
            after = requests.get(srv.url + "/specrl/status", timeout=30).json().get("adaptive_k")
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    tokens, seconds = sum(t for t, _ in waves), sum(s for _, s in waves)
    return {"proposer": "eagle3" if draft is not None else "plain", "background_process": background or None,
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "step_overhead_ms": (after or {}).get("step_overhead_ms"),
            "steps": (after or {}).get("steps", 0) - (before or {}).get("steps", 0) if after else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--draft", type=Path, required=True, help="EAGLE-3 draft (the demo's)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--warm-up-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cells", default="eagle3,eagle3+bg,eagle3+bgpin",
                    help="comma list of eagle3 / plain, +bg for the trainer-like background process, +bgpin for "
                         "it pinned to the last core (not the worker's)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_background_load.json"))
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    from vllm_specrl.fixtures import fixture_target

    model = Path(fixture_target("real", args.fixtures))
    rounds = []
    for r in range(args.rounds):
        cells = []
        for name in args.cells.split(","):
            proposer, _, background = name.partition("+")
            if background not in ("", "bg", "bgpin"):
                raise SystemExit(f"unknown cell {name!r}: eagle3 / plain, optionally +bg or +bgpin")
            cell = {"cell": name, **run_cell(model, args.draft if proposer == "eagle3" else None, background, args)}
            cells.append(cell)
            print(f"[load] round {r} {name:14s}: {cell['tokens_per_s']:6.1f} tok/s, outside the runner "
                  f"{cell['step_overhead_ms'] if cell['step_overhead_ms'] is not None else '-'} ms/step", flush=True)
        rounds.append(cells)
    # Every cell against the round's first cell: within a round only (the VM's speed drifts between rounds).
    ratios: dict[str, dict] = {}
    for cells in rounds:
        ref = cells[0]["tokens_per_s"]
        for c in cells:
            ratios.setdefault(c["cell"], {"tok_s_vs_first_cell": []})["tok_s_vs_first_cell"].append(
                c["tokens_per_s"] / ref)
    for key, r in ratios.items():
        r["median"] = statistics.median(r["tok_s_vs_first_cell"])
        print(f"[load] {key:14s} tok/s vs the round's first cell: "
              + ", ".join(f"{x:.3f}" for x in r["tok_s_vs_first_cell"]) + f" (median {r['median']:.3f})", flush=True)
    args.out.write_text(json.dumps({"benchmark": "background_load", "host": host_info(), "model": str(model),
                                    "settings": {k: str(v) for k, v in vars(args).items()},
                                    "rounds": rounds, "ratios": ratios}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
