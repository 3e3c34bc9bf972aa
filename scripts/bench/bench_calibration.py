"""Calibration table: the trainer's acceptance estimate beside what vLLM serves, per position.

One in-process engine (its own subprocess) serves a draft at T=1 with probabilistic
drafting and reports ``vllm:spec_decode_num_accepted_tokens_per_pos``; the trainer
then estimates those counters from the same rollouts (``trainer.estimate_check``): the
served estimate (completion positions, vLLM's draft starts), the per-step chained
mean, and the estimate with prompt positions counted. JSON, one row per run.

    python scripts/bench/bench_calibration.py --target .fixtures/real/target \\
        --draft .fixtures/real/drafts/warm-arithmetic --prompt-set arithmetic --dtype bfloat16

``--drafter mtp`` serves the target's own MTP layer (``"method": "mtp"``; no ``--draft``), e.g. the
``real-mimo`` fixture, and estimates it with ``MTPTrainer``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def prompts_trained_on(draft: Path) -> set[str]:
    """The prompts a warm-started draft (``trainer_meta.json``) or the real-mimo fixture's MTP layer
    (its manifest) trained on, so the held-out set leaves them out."""
    from vllm_specrl.fixtures.layout import MANIFEST_NAME

    meta, manifest = draft / "trainer_meta.json", draft / MANIFEST_NAME
    if meta.is_file():
        return set(json.loads(meta.read_text()).get("warm_start", {}).get("train_prompt_texts", []))
    if manifest.is_file():
        return set(json.loads(manifest.read_text()).get("metrics", {}).get("train_prompts", []))
    return set()


def main() -> None:
    from vllm_specrl.host import host_info
    from vllm_specrl.trainer.estimate_check import estimate_from_rollouts, estimate_mtp_from_rollouts, serve_rollouts
    from vllm_specrl.trainer.offline import default_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", help="the EAGLE-3 draft (not with --drafter mtp)")
    ap.add_argument("--drafter", default="eagle3", choices=["eagle3", "mtp"])
    ap.add_argument("--prompt-set", default="arithmetic", choices=["chat", "arithmetic", "code", "explain"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=1,
                    help="T=1 rollouts per prompt (the explain task holds out only a few prompts)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=Path("results/bench_calibration.json"))
    args = ap.parse_args()
    if (args.drafter == "eagle3") != (args.draft is not None):
        ap.error("--draft names the EAGLE-3 draft; --drafter mtp serves the target's own MTP layer")

    trained = prompts_trained_on(Path(args.draft or args.target))
    if args.prompt_set == "code":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        from prompts import code_prompts

        prompts = code_prompts(300 + args.prompts)[300:]
    else:
        prompts = [p for p in default_prompts(4 * args.prompts + 64, 4321, args.prompt_set)
                   if p not in trained][: args.prompts]
    prompts = [p for p in prompts for _ in range(args.samples)]
    t0 = time.time()
    served = serve_rollouts(args.target, args.draft, prompts, args.k, args.dtype, args.max_tokens,
                            args.ignore_eos, chat=args.prompt_set != "code")
    if args.drafter == "mtp":
        est = estimate_mtp_from_rollouts(args.target, served["sequences"], served["prompt_lengths"], args.k)
    else:
        est = estimate_from_rollouts(args.target, args.draft, served["sequences"], served["prompt_lengths"], args.k)
    sd = served["spec_decode"]
    row = {"label": args.label or f"{Path(args.target).parent.name} {args.dtype}", "target": args.target,
           "draft": args.draft or f"{args.target} (its MTP layer)", "drafter": args.drafter, "dtype": args.dtype,
           "k": args.k, "temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
           "prompt_set": args.prompt_set, "prompts": len(prompts) // args.samples,
           "samples": args.samples, "held_out_from_training": bool(trained),
           "served": {"per_position": sd["per_position_acceptance"], "acceptance_length": sd["acceptance_length"],
                      "num_drafts": sd["num_drafts"]},
           "estimate": est, "seconds": round(time.time() - t0, 1), "host": host_info(),
           "completion_tokens": sum(len(s) - n for s, n in zip(served["sequences"], served["prompt_lengths"]))}
    rows = json.loads(args.out.read_text()) if args.out.is_file() else []
    rows = [r for r in rows if r["label"] != row["label"]] + [row]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
