#!/usr/bin/env python
"""The RL loop's policy phases (log-prob pass, GRPO update) under each glibc allocator mode.

Each mode runs in a fresh interpreter (allocator settings are process state): ``default``
(glibc untouched), ``tuned`` (``cpu_malloc.tune_glibc_malloc``, what vLLM processes get) and
``heap`` (``cpu_malloc.keep_every_block_on_heap``, what training processes get). Every step is a
16-sample batch shaped like a demo step (random completion lengths up to the cap), and the JSON
records seconds per generated token and the page faults of each phase. The modes alternate over
rounds, since this VM's page-fault cost drifts over minutes.

    python scripts/bench/bench_policy_step.py --fixtures .fixtures --out benchmarks/cpu/bench_policy_step_malloc.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODES = ("default", "tuned", "heap")

CHILD = r"""
import json, random, resource, sys, time
from pathlib import Path
from vllm_specrl.cpu import malloc as cpu_malloc

mode, target, steps, samples, max_tokens = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:6])
result = {"default": lambda: "untouched", "tuned": cpu_malloc.tune_glibc_malloc,
          "heap": cpu_malloc.keep_every_block_on_heap}[mode]()
from vllm_specrl.rl.policy import Policy

policy = Policy(target, 2e-6, 0)
prompt = policy.tok(policy.chat("Explain why 12 + 30 = 42, step by step."))["input_ids"]
vocab = policy.model.config.vocab_size

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

out = []
for step in range(steps):
    rng = random.Random(step)
    lengths = [rng.randint(16, max_tokens) for _ in range(samples)]
    batch = [{"prompt_ids": prompt, "completion_ids": [rng.randint(0, vocab - 1) for _ in range(n)],
              "vllm_logprobs": [0.0] * n, "reward": float(i % 2)} for i, n in enumerate(lengths)]
    tokens = sum(lengths)
    f0, t0 = faults(), time.perf_counter()
    logps = policy.token_logprobs(batch)
    f1, t1 = faults(), time.perf_counter()
    policy.grpo_step(batch, logps, 4, 0.2)
    f2, t2 = faults(), time.perf_counter()
    out.append({"step": step, "tokens": tokens, "logprob_ms_per_token": 1e3 * (t1 - t0) / tokens,
                "update_ms_per_token": 1e3 * (t2 - t1) / tokens, "logprob_faults": f1 - f0, "update_faults": f2 - f1})
print(json.dumps({"mode": mode, "allocator": result, "steps": out,
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def run_mode(mode: str, target: Path, args: argparse.Namespace) -> dict:
    from vllm_specrl.cpu.malloc import environ_without_malloc_settings

    env_clean = environ_without_malloc_settings()
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(target), str(args.steps), str(args.samples),
                          str(args.max_tokens)], env=env_clean, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{mode}: the measuring process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict], skip: int) -> dict:
    """Per mode: mean ms per token and faults per phase over the steps after the first ``skip``."""
    summary = {}
    for mode in MODES:
        steps = [s for r in runs if r["mode"] == mode for s in r["steps"][skip:]]
        if steps:
            summary[mode] = {k: sum(s[k] for s in steps) / len(steps) for k in
                             ("logprob_ms_per_token", "update_ms_per_token", "logprob_faults", "update_faults")}
            summary[mode]["max_rss_mib"] = max(r["max_rss_mib"] for r in runs if r["mode"] == mode)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=None, help="policy checkpoint (default: the real fixture)")
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip", type=int, default=1, help="steps per process left out of the summary (warm-up)")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("results/bench_policy_step.json"))
    args = ap.parse_args()
    if args.target is None:
        from vllm_specrl.fixtures import fixture_target

        args.target = Path(fixture_target("real", args.fixtures))
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    runs = []
    for r in range(args.rounds):
        for mode in modes:
            t0 = time.perf_counter()
            runs.append({**run_mode(mode, args.target, args), "round": r})
            s = runs[-1]["steps"]
            print(f"round {r} {mode:8s} {time.perf_counter() - t0:5.1f}s  logp ms/token "
                  + " ".join(f"{x['logprob_ms_per_token']:.2f}" for x in s) + "  faults "
                  + " ".join(str(x["logprob_faults"] + x["update_faults"]) for x in s), flush=True)
    report = {"bench": "policy_step", "settings": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
              "summary": summarize(runs, args.skip)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for mode, s in report["summary"].items():
        print(f"{mode:8s} logp {s['logprob_ms_per_token']:.2f} ms/token ({s['logprob_faults']:.0f} faults), "
              f"update {s['update_ms_per_token']:.2f} ms/token ({s['update_faults']:.0f} faults), "
              f"max RSS {s['max_rss_mib']} MiB")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
