"""Does changing k between steps lower the draft's acceptance? (adaptive k's premise)

Adaptive k changes the number of drafts from one step to the next; the drafter's first pass
then starts from a step that verified another number of drafts. If that left the drafter
reading the wrong rows (hidden states, KV), drafts would still be verified (lossless) but
accepted less often, and adaptive k would lose to the fixed k it switches between. This runs
the same seeded requests (one sequence at a time, T=1) through the adaptive scheduler with k
forced per step: ``fixed3`` (always 3) and ``random123`` (1, 2 or 3 drawn per step), one
engine per process, and compares each position's conditional acceptance (the controller's
undecayed counts, which equal vLLM's ``spec_decode`` counters at fixed k) with a z-test.

    python scripts/check_k_switch_acceptance.py --fixtures .fixtures \
        --draft .fixtures/real/drafts/demo-explain --requests 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

SCHEDULER = "vllm_specrl.adaptive.scheduler.AdaptiveKScheduler"


def run_policy(cfg: dict) -> dict:
    """One engine, k forced per step by ``cfg["policy"]``; the controller's counts and vLLM's."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_specrl.adaptive import controller

    rng = random.Random(cfg["seed"])
    choices = [int(c) for c in cfg["policy"].removeprefix("fixed").removeprefix("random")]

    def forced_lookup(self: controller.AdaptiveKController, calibrating: bool = False) -> list[int]:
        return [rng.choice(choices)] * (self.max_batch + 1)

    controller.AdaptiveKController.lookup_for_step = forced_lookup
    from vllm import LLM, SamplingParams

    from vllm_specrl import metrics
    from vllm_specrl.adaptive import state

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_rollout import make_prompts

    spec = {"method": "eagle3", "model": cfg["draft"], "num_speculative_tokens": max(choices),
            "draft_sample_method": "probabilistic"}
    llm = LLM(model=cfg["target"], dtype=cfg["dtype"], enforce_eager=True, seed=cfg["seed"],
              max_model_len=1024, max_num_seqs=4, speculative_config=spec, disable_log_stats=False,
              scheduler_cls=SCHEDULER, additional_config={"specrl": {"adaptive_k": {"decay": 1.0}}})
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in make_prompts(8, "chat")]
    tokens, t0 = 0, time.perf_counter()
    for j in range(cfg["requests"]):
        out = llm.generate([prompts[(j // 4) % len(prompts)]],
                           SamplingParams(temperature=1.0, max_tokens=cfg["max_tokens"], ignore_eos=True, seed=j),
                           use_tqdm=False)
        tokens += len(out[0].outputs[0].token_ids)
    ctl = state.read() or {}
    return {"policy": cfg["policy"], "tokens": tokens, "wall_s": round(time.perf_counter() - t0, 2),
            "chosen_k_counts": ctl.get("chosen_k_counts"), "conditional_acceptance": ctl.get("conditional_acceptance"),
            "drafts_reaching_position": ctl.get("acceptance_drafts"),
            "spec_decode": metrics.from_llm_metrics(llm.get_metrics()).summary()}


def z_test(a: dict, b: dict) -> list[float | None]:
    """Per position: (b - a) in standard errors of the difference of two proportions."""
    out = []
    for pa, na, pb, nb in zip(a["conditional_acceptance"], a["drafts_reaching_position"],
                              b["conditional_acceptance"], b["drafts_reaching_position"]):
        se = (pa * (1 - pa) / max(na, 1) + pb * (1 - pb) / max(nb, 1)) ** 0.5
        out.append(round((pb - pa) / se, 2) if se > 0 else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=Path(".fixtures"))
    ap.add_argument("--draft", type=Path, default=Path(".fixtures/real/drafts/demo-explain"))
    ap.add_argument("--policies", default="fixed3,random123")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--_engine", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path("results/check_k_switch_acceptance.json"))
    args = ap.parse_args()
    if args._engine:
        from vllm_specrl.bench_engine import report_result

        report_result(run_policy(json.loads(args._engine)))
        return
    from vllm_specrl.bench_engine import host_info, run_engine_subprocess

    base = {"target": str(args.fixtures / "real" / "target"), "draft": str(args.draft), "requests": args.requests,
            "max_tokens": args.max_tokens, "dtype": args.dtype, "seed": args.seed}
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results = []
    for policy in args.policies.split(","):
        res = run_engine_subprocess(__file__, dict(base, policy=policy), env, args.timeout)
        if isinstance(res, str):
            sys.exit(f"{policy}: {res}")
        results.append(res)
        print(json.dumps(res), flush=True)
    report = {"check": "k_switch_acceptance", "host": host_info(), "settings": base, "results": results,
              "z_vs_first": {r["policy"]: z_test(results[0], r) for r in results[1:]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["z_vs_first"]))


if __name__ == "__main__":
    main()
