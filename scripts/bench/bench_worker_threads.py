"""How many cores vLLM's CPU worker gets on a small machine: its default vs all of them.

vLLM's CPU backend reserves one core per rank for its scheduler process
(``VLLM_CPU_NUM_OF_RESERVED_CPU``) and binds the worker's OpenMP threads to the
rest: on a 2-core machine the worker computes on one core. This measures vLLM's
default against ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (the worker's OpenMP threads on
every core, the scheduler sharing them), plain and EAGLE-3 (k = 3, probabilistic
drafting), engines alone on the machine, through ``vllm serve``
(the multi-process engine RL jobs run), T=1, seeded, ``ignore_eos``: wall time of
one wave of ``batch`` requests of ``--tokens`` tokens, best of ``--waves``.

    python scripts/bench/bench_worker_threads.py --draft .fixtures/real/drafts/demo-explain

Not the default anywhere: alone, both engines ran faster with every core; in the RL
demo, where the worker's capture thread and the online draft trainer share those cores, the
speculative run's generation became slower while the plain run's became faster
(benchmarks/JOURNAL.md has the figures; an OpenMP barrier waits for its slowest thread, and any other
runnable thread on a bound core makes one slow).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_engine import completion_wave, host_info
from vllm_specrl.launcher import VLLMServer, cpu_env

RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"  # vLLM's own knob (vllm/utils/ompmultiprocessing.py)

PROMPT = ("<|im_start|>user\nWhat is {i} + 3? Explain your reasoning briefly, then give the answer.<|im_end|>\n"
          "<|im_start|>assistant\n")


def measure(url: str, model: str, batch: int, tokens: int, waves: int) -> dict:
    times = []
    for _ in range(waves):
        counts, seconds = completion_wave(url, model, [PROMPT.format(i=i) for i in range(batch)], tokens,
                                          seeds=list(range(batch)), timeout_s=900)
        assert sum(counts) == batch * tokens
        times.append(seconds)
    return {"best_s": min(times), "waves_s": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path(".fixtures/real/target"))
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--batch-sizes", default="16,1")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path("results/bench_worker_threads.json"))
    args = ap.parse_args()
    spec = {"method": "eagle3", "model": str(args.draft), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}
    cells = []
    for reserved in ("vllm_default", "0"):
        for mode in ("plain", "spec"):
            env = cpu_env()
            env.pop(RESERVED_CPU_ENV, None)
            if reserved != "vllm_default":
                env[RESERVED_CPU_ENV] = reserved
            extra = ["--dtype", args.dtype, "--max-model-len", "1024"]
            if mode == "spec":
                extra += ["--speculative-config", json.dumps(spec)]
            with VLLMServer(args.target, extra, env=env) as srv:
                measure(srv.url, srv.model, 1, 16, 1)  # warm-up
                for batch in (int(b) for b in args.batch_sizes.split(",")):
                    cell = {"reserved_cpus": reserved, "mode": mode, "batch": batch,
                            **measure(srv.url, srv.model, batch, args.tokens, args.waves)}
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
    best = {(c["reserved_cpus"], c["mode"], c["batch"]): c["best_s"] for c in cells}
    summary = {f"{mode}_b{b}_all_cores_vs_default": best[("0", mode, b)] / best[("vllm_default", mode, b)]
               for (r, mode, b) in best if r == "0"}
    summary.update({f"spec_vs_plain_b{b}_{r}": best[(r, "spec", b)] / best[(r, "plain", b)]
                    for (r, mode, b) in best if mode == "spec"})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"host": host_info(), "settings": {k: str(v) for k, v in vars(args).items()},
                                    "cells": cells, "summary": summary}, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
