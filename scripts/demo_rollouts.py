"""`make demo`: rollouts from `vllm serve` with vllm-specrl, as an RL loop makes them.

Starts `vllm serve` on the real fixture (SmolLM2-135M-Instruct) with the
plugin, the worker extension and an API key; sends several prompts x G
samples at temperature 1 with logprobs through the official `openai` client
(GRPO-style groups, concurrently, as rollout workers do); prints throughput
and `/specrl/status`; shuts the server down.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

from vllm_specrl.fixtures import fixture_target
from vllm_specrl.launcher import VLLMServer

API_KEY = "specrl-demo-key"


def arithmetic_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        out.append(f"What is {a} + {b}? Answer with the number, then explain briefly.")
    return out


def rollout_group(client: OpenAI, model: str, prompt: str, group_size: int,
                  max_tokens: int, seed: int) -> dict:
    """One GRPO group: G samples of one prompt at T=1 with per-token logprobs."""
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], n=group_size,
        temperature=1.0, top_p=1.0, max_tokens=max_tokens, logprobs=True, seed=seed,
    )
    samples = []
    for choice in resp.choices:
        logprobs = [t.logprob for t in (choice.logprobs.content or [])]
        samples.append({"text": choice.message.content, "num_tokens": len(logprobs),
                        "sum_logprob": sum(logprobs)})
    return {"prompt": prompt, "samples": samples,
            "completion_tokens": resp.usage.completion_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--fixture", default="real", choices=["real", "tiny"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative-config", default=None,
                    help="JSON passed to vllm serve --speculative-config")
    ap.add_argument("--log", type=Path, default=Path("results/demo_server.log"))
    ap.add_argument("--out", type=Path, default=Path("results/demo_rollouts.json"))
    args = ap.parse_args()

    model = fixture_target(args.fixture, args.fixtures)
    extra = ["--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "32"]
    if args.speculative_config:
        extra += ["--speculative-config", args.speculative_config]
    args.log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[demo] starting vllm serve {model} (log: {args.log})", flush=True)
    t_start = time.time()
    with VLLMServer(model, extra, api_key=API_KEY, log_path=args.log) as server:
        print(f"[demo] server ready at {server.url} in {time.time() - t_start:.0f}s", flush=True)
        client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
        served = client.models.list().data[0].id
        prompts = arithmetic_prompts(args.prompts, args.seed)
        t0 = time.time()
        with ThreadPoolExecutor(args.concurrency) as pool:
            groups = list(pool.map(
                lambda ip: rollout_group(client, served, ip[1], args.group_size,
                                         args.max_tokens, args.seed + ip[0]),
                enumerate(prompts)))
        wall = time.time() - t0
        status = server.status()

    tokens = sum(g["completion_tokens"] for g in groups)
    samples = sum(len(g["samples"]) for g in groups)
    report = {
        "fixture": args.fixture, "prompts": args.prompts, "group_size": args.group_size,
        "max_tokens": args.max_tokens, "concurrency": args.concurrency,
        "speculative_config": args.speculative_config, "wall_s": round(wall, 2),
        "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
        "samples_per_s": round(samples / wall, 2), "status": status,
        "example": {"prompt": groups[0]["prompt"], "sample": groups[0]["samples"][0]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\n[demo] example rollout for {groups[0]['prompt']!r}:\n  {groups[0]['samples'][0]['text']!r}")
    print(f"[demo] {samples} rollouts ({args.prompts} prompts x G={args.group_size}), "
          f"{tokens} tokens in {wall:.1f}s: {tokens / wall:.1f} tok/s, {samples / wall:.2f} rollouts/s")
    print("[demo] /specrl/status:")
    print(json.dumps(status, indent=2))
    print(f"[demo] report: {args.out}")


if __name__ == "__main__":
    main()
