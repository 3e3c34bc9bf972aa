"""Do speculative rollouts end where plain ones do? Completion lengths at T=1, stopping at EOS.

RL rollouts stop at EOS; a fault in how an engine ends a request whose stop token lies inside a
block of accepted drafts would change the length distribution (and so the reward) without
changing any token's probability given its prefix. This samples the demo's requests (the
``explain`` task, chat template, seeded n = G groups as the rollout client sends them, up to
``--max-tokens``) from plain vLLM and from speculative engines on the real fixture, one engine per
process, and compares the completion lengths (Mann-Whitney U and Kolmogorov-Smirnov).

    python scripts/check_stop_lengths.py --draft .fixtures/real/drafts/demo-explain --reps 40

writes ``results/check_stop_lengths.json``. The tiny-fixture test of the same property is
``tests/test_lossless_sampling.py::test_stop_tokens_end_speculative_samples_as_plain``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_specrl.adaptive import SCHEDULER_CLS  # noqa: E402
from vllm_specrl.bench_engine import host_info  # noqa: E402

MODES = ("plain", "fixed", "adaptive")


def _engine(cfg: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_specrl.rl.tasks import make_tasks

    extra: dict = {}
    spec = None
    if cfg["mode"] != "plain":
        spec = {"method": "eagle3", "model": cfg["draft"], "num_speculative_tokens": cfg["k"]}
    if cfg["mode"] == "adaptive":
        extra = {"scheduler_cls": SCHEDULER_CLS, "additional_config": {"specrl": {"adaptive_k": {}}}}
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=True, seed=0, max_model_len=1024,
              max_num_seqs=cfg["prompts"] * cfg["group"], speculative_config=spec, **extra)
    tok = llm.get_tokenizer()
    lengths, t0 = [], time.perf_counter()
    for rep in range(cfg["reps"]):
        tasks = make_tasks(rep, cfg["prompts"], 0, "explain")
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True) for p, _ in tasks]
        params = [SamplingParams(n=cfg["group"], temperature=1.0, max_tokens=cfg["max_tokens"],
                                 seed=(rep * cfg["prompts"] + i) * cfg["group"]) for i in range(len(texts))]
        for out in llm.generate(texts, params, use_tqdm=False):
            lengths += [len(c.token_ids) for c in out.outputs]
    return {"lengths": lengths, "wall_s": round(time.perf_counter() - t0, 1)}


def summary(lengths: list[int], max_tokens: int) -> dict:
    return {"samples": len(lengths), "mean": round(statistics.mean(lengths), 2),
            "median": statistics.median(lengths), "capped": sum(n >= max_tokens for n in lengths)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=Path(".fixtures"))
    ap.add_argument("--draft", type=Path, default=Path(".fixtures/real/drafts/demo-explain"))
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}; plain first")
    ap.add_argument("--reps", type=int, default=40, help="batches of prompts x group samples")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=Path("results/check_stop_lengths.json"))
    ap.add_argument("--_engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._engine:
        from vllm_specrl.bench_engine import report_result

        report_result(_engine(json.loads(args._engine)))
        return
    from scipy.stats import ks_2samp, mannwhitneyu

    from vllm_specrl.bench_engine import run_engine_subprocess
    from vllm_specrl.server import with_intel_openmp

    modes = args.modes.split(",")
    if modes[0] != "plain" or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes must start with plain and come from {MODES}")
    env = with_intel_openmp(dict(os.environ))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    base = {"model": str(args.fixtures / "real" / "target"), "draft": str(args.draft), "reps": args.reps,
            "prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens, "k": args.k,
            "dtype": args.dtype}
    report = {"check": "stop_lengths", "host": host_info(), "settings": base, "modes": {}}
    plain = None
    for mode in modes:
        res = run_engine_subprocess(__file__, dict(base, mode=mode), env, args.timeout)
        if isinstance(res, str):
            raise SystemExit(f"{mode}: {res}")
        row = {**summary(res["lengths"], args.max_tokens), "wall_s": res["wall_s"], "lengths": res["lengths"]}
        if plain is None:
            plain = res["lengths"]
        else:
            row["vs_plain"] = {"mann_whitney_p": float(mannwhitneyu(plain, res["lengths"]).pvalue),
                               "ks_p": float(ks_2samp(plain, res["lengths"]).pvalue)}
        report["modes"][mode] = row
        print(f"[stop-lengths] {mode}: {json.dumps({k: v for k, v in row.items() if k != 'lengths'})}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
