"""Rollout throughput of vLLM on a fixture, plain vs speculative configs, in one run.

Each (config, mode, batch size) cell runs in its own subprocess (vLLM allows
one engine per process) on the same prompts and seeds. Modes:
- ``offline``: ``vllm.LLM`` in-process engine, ``max_num_seqs`` = batch size;
- ``server``: ``vllm serve`` with the plugin, ``batch size`` concurrent
  OpenAI requests (how RL frameworks drive rollout servers).
Every speculative cell is reported as a ratio against the plain cell of the
same mode and batch size measured in this run, plus the acceptance figures
from vLLM's ``vllm:spec_decode_*`` counters. Output: one JSON file.

    python scripts/bench_rollout.py --fixture real --speculative-config '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":3}'
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

PLAIN = "plain"


def make_prompts(n: int) -> list[str]:
    topics = ["a binary search", "a stack", "reading a CSV file", "a retry loop",
              "merging two dicts", "a tiny HTTP client", "a prime sieve", "an LRU cache"]
    return [f"Write a short Python function for {topics[i % len(topics)]} (variant {i})."
            for i in range(n)]


# --- one cell, run in a subprocess ------------------------------------------------

def _cell_offline(cfg: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_specrl import metrics

    spec = json.loads(cfg["speculative_config"]) if cfg["speculative_config"] else None
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=True, seed=cfg["seed"],
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["batch_size"],
              speculative_config=spec, disable_log_stats=False)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True) for p in cfg["prompts"]]
    # One request per sample (n=1, its own seed), as the server cells send them;
    # vLLM also rejects n>1 with greedy sampling.
    jobs = [(prompt, SamplingParams(temperature=cfg["temperature"], max_tokens=cfg["max_tokens"],
                                    ignore_eos=True, seed=cfg["seed"] + i * cfg["samples"] + s))
            for i, prompt in enumerate(prompts) for s in range(cfg["samples"])]
    llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    before = metrics.from_llm_metrics(llm.get_metrics())
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in jobs], [sp for _, sp in jobs], use_tqdm=False)
    wall = time.perf_counter() - t0
    spec_stats = metrics.from_llm_metrics(llm.get_metrics()).minus(before).summary()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"wall_s": wall, "tokens": tokens, "requests": len(jobs),
            "spec_decode": spec_stats if spec else None}


def _cell_server(cfg: dict) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import requests
    from openai import OpenAI

    from vllm_specrl import metrics
    from vllm_specrl.server import VLLMServer

    extra = ["--dtype", cfg["dtype"], "--max-model-len", str(cfg["max_model_len"]),
             "--max-num-seqs", str(cfg["batch_size"]), "--seed", str(cfg["seed"])]
    if cfg["speculative_config"]:
        extra += ["--speculative-config", cfg["speculative_config"]]
    log = Path(cfg["log_dir"]) / f"server_{cfg['name']}_b{cfg['batch_size']}.log"
    with VLLMServer(cfg["model"], extra, log_path=log) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none")
        model = client.models.list().data[0].id

        def one(i_prompt):
            i, prompt = i_prompt
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}],
                temperature=cfg["temperature"], max_tokens=cfg["max_tokens"], seed=cfg["seed"] + i,
                logprobs=True, extra_body={"ignore_eos": True})
            return r.usage.completion_tokens

        jobs = [(i * cfg["samples"] + s, p) for i, p in enumerate(cfg["prompts"])
                for s in range(cfg["samples"])]
        one((0, cfg["prompts"][0]))  # warm-up
        before = metrics.from_prometheus_text(requests.get(srv.url + "/metrics", timeout=30).text)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(cfg["batch_size"]) as pool:
            tokens = sum(pool.map(one, jobs))
        wall = time.perf_counter() - t0
        after = metrics.from_prometheus_text(requests.get(srv.url + "/metrics", timeout=30).text)
    return {"wall_s": wall, "tokens": tokens, "requests": len(jobs),
            "spec_decode": after.minus(before).summary() if cfg["speculative_config"] else None}


def run_cell(cfg: dict) -> dict:
    result = (_cell_offline if cfg["mode"] == "offline" else _cell_server)(cfg)
    result["tokens_per_s"] = result["tokens"] / result["wall_s"]
    result["requests_per_s"] = result["requests"] / result["wall_s"]
    return result


# --- driver -------------------------------------------------------------------------

def run_in_subprocess(cfg: dict, timeout_s: float) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_PLUGINS", "specrl,specrl_http")
    proc = subprocess.run([sys.executable, __file__, "--_cell", json.dumps(cfg)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("CELL_RESULT "):
            return json.loads(line[len("CELL_RESULT "):])
    tail = (proc.stdout + proc.stderr)[-3000:]
    return {"error": f"cell failed (rc={proc.returncode}): {tail}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--_cell", help=argparse.SUPPRESS)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--fixture", default="real", choices=["real", "tiny"])
    ap.add_argument("--model", default=None, help="model dir (overrides --fixture)")
    ap.add_argument("--speculative-config", action="append", default=[],
                    help="JSON speculative config to compare with plain (repeatable)")
    ap.add_argument("--modes", default="offline,server")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=2, help="G samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cell-timeout", type=float, default=1200)
    ap.add_argument("--out", type=Path, default=Path("results/bench_rollout.json"))
    args = ap.parse_args()

    if args._cell:
        print("CELL_RESULT " + json.dumps(run_cell(json.loads(args._cell))), flush=True)
        return

    from vllm_specrl.fixtures import fixture_target

    model = str(args.model or fixture_target(args.fixture, args.fixtures))
    configs = [(PLAIN, None)] + [(f"spec{i}", s) for i, s in enumerate(args.speculative_config)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cells = []
    for mode in args.modes.split(","):
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            plain_tps = None
            for name, spec in configs:
                cfg = {"name": name, "mode": mode, "batch_size": batch, "model": model,
                       "speculative_config": spec, "prompts": make_prompts(args.prompts),
                       "samples": args.samples, "max_tokens": args.max_tokens,
                       "temperature": args.temperature, "dtype": args.dtype,
                       "max_model_len": args.max_model_len, "seed": args.seed,
                       "log_dir": str(args.out.parent)}
                print(f"[bench] {mode} batch={batch} {name} {spec or ''}", flush=True)
                res = run_in_subprocess(cfg, args.cell_timeout)
                cell = {k: cfg[k] for k in ("name", "mode", "batch_size", "speculative_config")}
                cell.update(res)
                if "error" not in res:
                    if name == PLAIN:
                        plain_tps = res["tokens_per_s"]
                    elif plain_tps:
                        cell["throughput_ratio_vs_plain"] = res["tokens_per_s"] / plain_tps
                    print(f"[bench]   {res['tokens_per_s']:.1f} tok/s"
                          + (f", ratio {cell.get('throughput_ratio_vs_plain', 1.0):.2f}"
                             if name != PLAIN else ""), flush=True)
                else:
                    print(f"[bench]   FAILED: {res['error'][-500:]}", flush=True)
                cells.append(cell)
    report = {
        "benchmark": "rollout_throughput", "model": model, "fixture": None if args.model else args.fixture,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "settings": {k: getattr(args, k) for k in ("prompts", "samples", "max_tokens",
                                                   "temperature", "dtype", "seed")},
        "cells": cells,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
