"""Where a speculative step's time goes on this CPU: plain vs EAGLE-3 steps, by phase.

One in-process engine per configuration (plain; EAGLE-3 at k = 1..3, with the
plugin's inverse-CDF sampling and with vLLM's exponential race,
``VLLM_SPECRL_FAST_SAMPLING=0``), each in its own subprocess. Every engine decodes
``batch`` seeded temperature-1 requests together (ignore_eos, fixed length), and
phase timers (``phase_timers.install_phase_timers``) split each engine step into:
target forward, target logits, sampler (bonus / plain tokens), rejection sampler,
and the drafter's share (its forward passes, its logits and sampling, the rest of
``propose``: metadata and input preparation). ``other`` is what is left of the step
(input preparation, bookkeeping). Units: ms per engine step, and the step's cost in
plain steps at the same batch size (this run's plain engine).

    python scripts/bench/bench_step_cost.py                       # real fixture, k=1..3, b=1,4,16
    python scripts/bench/bench_step_cost.py --ks 3 --batch-sizes 1 --tokens 32
    # with a P-EAGLE draft beside:
    python scripts/bench/bench_step_cost.py --ks 3 --batch-sizes 1 --sampling fast --parallel-draft DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from vllm_specrl.adaptive import SCHEDULER_CLS
from bench_engine import host_info

PHASE_ORDER = ("wall", "target_forward", "target_logits", "sampler", "rejection_sampler", "draft_forward",
               "draft_logits_and_sampling", "draft_other", "other")


def _engine(cfg: dict) -> list[dict]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from phase_timers import install_phase_timers

    from vllm_specrl import metrics

    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=not cfg.get("compiled"), seed=0,
              max_model_len=cfg["max_model_len"], max_num_seqs=max(cfg["batch_sizes"]),
              speculative_config=cfg["speculative_config"], disable_log_stats=False,
              **({"scheduler_cls": cfg["scheduler_cls"]} if cfg.get("scheduler_cls") else {}))
    llm.collective_rpc(lambda worker: install_phase_timers(worker.model_runner) and None)

    def totals() -> dict:
        return llm.collective_rpc(lambda worker: dict(worker.model_runner._specrl_phase_totals))[0]

    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True) for p in cfg["prompts"]]
    # Warm-up at every batch size with the measured requests' options: the first logprobs request
    # compiles vLLM's rank computation (~1.5 s), which would land in the first measured batch size.
    for batch in cfg["batch_sizes"]:
        llm.generate(prompts[:batch], SamplingParams(max_tokens=8, temperature=1.0, seed=0,
                                                     logprobs=cfg.get("logprobs")), use_tqdm=False)
    rows = []
    for batch in cfg["batch_sizes"]:
        before, stats0 = totals(), metrics.from_llm_metrics(llm.get_metrics())
        t0, tokens = time.perf_counter(), 0
        for wave in range(cfg["waves"]):
            params = [SamplingParams(temperature=1.0, max_tokens=cfg["tokens"], ignore_eos=True,
                                     seed=1000 * wave + i, logprobs=cfg.get("logprobs")) for i in range(batch)]
            outs = llm.generate([prompts[i % len(prompts)] for i in range(batch)], params, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        wall = time.perf_counter() - t0
        after = totals()
        diff = {k: after[k] - before[k] for k in after}
        steps = max(diff.pop("steps"), 1)
        diff.pop("forward_calls", None)
        ms = {k: 1e3 * v / steps for k, v in diff.items()}
        ms["draft_other"] = ms["propose"] - ms["draft_forward"] - ms["draft_logits_and_sampling"]
        ms["other"] = ms["step"] - sum(ms[k] for k in ("target_forward", "target_logits", "sampler",
                                                        "rejection_sampler", "propose"))
        spec = metrics.from_llm_metrics(llm.get_metrics()).minus(stats0).summary()
        ms["wall"] = 1e3 * wall / steps   # the runner's step plus the scheduler and output handling
        rows.append({"batch_size": batch, "engine_steps": steps, "tokens": tokens, "wall_s": round(wall, 3),
                     "tokens_per_s": tokens / wall, "ms_per_step": {k: round(v, 3) for k, v in ms.items()},
                     "spec_decode": spec if cfg["speculative_config"] else None})
    return rows


def run_engine(cfg: dict, env_extra: dict, timeout_s: float, iomp: bool = True) -> list[dict] | str:
    from bench_engine import run_engine_subprocess
    from vllm_specrl.launcher import with_intel_openmp

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               VLLM_PLUGINS=os.environ.get("VLLM_PLUGINS", "specrl"), **env_extra)
    if iomp:
        env = with_intel_openmp(env)
    return run_engine_subprocess(__file__, cfg, env, timeout_s)


def table(report: dict) -> str:
    """Markdown: ms per step by phase, per configuration and batch size."""
    head = "| config | b | step ms | " + " | ".join(PHASE_ORDER) + " | step / plain | accept len | tok/s / plain |"
    lines = [head, "|" + "---|" * (len(PHASE_ORDER) + 6)]
    for row in report["rows"]:
        if "error" in row:
            continue
        ms = row["ms_per_step"]
        acc = (row.get("spec_decode") or {}).get("acceptance_length")
        lines.append(f"| {row['name']} | {row['batch_size']} | {ms['step']:.1f} | "
                     + " | ".join(f"{ms.get(p, 0.0):.1f}" for p in PHASE_ORDER)
                     + f" | {row.get('step_cost_vs_plain', 1.0):.2f} | {acc or 1.0:.2f} | "
                     f"{row.get('throughput_ratio_vs_plain', 1.0):.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--_engine", help=argparse.SUPPRESS)
    ap.add_argument("--fixture", default="real", choices=["real", "tiny"])
    ap.add_argument("--fixtures", type=Path, default=Path(".fixtures"), help="fixture root (make fixtures)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", type=Path, default=None,
                    help="EAGLE-3 draft (default: the real fixture's warm-started draft, `make draft`)")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--sampling", default="fast,stock",
                    help="fast (plugin), lazy (the plugin's without its one-pass verify: vLLM's rejection "
                         "sampler forward around the lazy recovery), "
                         "eager (the plugin's inverse-CDF samplers with vLLM's recovered token "
                         "for every draft row and its logprobs of every row), fullvocab (the plugin's, with a "
                         "reduced-vocabulary draft sampled over the target's whole vocabulary, as vLLM does), "
                         "spread (the plugin's, with the draft's probabilities spread over the target's "
                         "vocabulary in the drafter instead of kept compact to the verify) "
                         "and/or stock (vLLM's), or none "
                         "(no fixed-k engines)")
    ap.add_argument("--logprobs", type=int, default=None,
                    help="request this many logprobs per token (the RL rollout client asks for 0)")
    ap.add_argument("--parallel-draft", type=Path, default=None,
                    help="also run this P-EAGLE draft (train-draft --parallel-drafting) at each k with vLLM's "
                         "parallel drafting (all k drafts from one forward pass)")
    ap.add_argument("--adaptive", action="store_true", help="also run EAGLE-3 at max k with adaptive k")
    ap.add_argument("--held-at", default="",
                    help="also run EAGLE-3 at max k held at these k's by vLLM's batch-size table "
                         "(e.g. 0,1: what an adaptive engine's step costs at that k, without the controller); "
                         "with --parallel-draft, that draft too (at 0 and max k only)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration this many times, in turn (single engines differ by 10-15%%)")
    ap.add_argument("--compile", default="eager",
                    help="comma list of eager (enforce_eager, as the project serves) and/or compiled (vLLM's "
                         "torch.compile with inductor, about 50 s more per engine start): each configuration "
                         "runs in every listed mode, named with a _compiled suffix when compiled")
    ap.add_argument("--prompt-set", default="arithmetic", choices=["arithmetic", "explain", "chat"],
                    help="the prompts' task family (explain: the RL demo's, what its draft was trained on)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-iomp", action="store_true", help="do not LD_PRELOAD Intel OpenMP (vLLM's advice)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_step_cost.json"))
    args = ap.parse_args()
    if args._engine:
        from bench_engine import report_result

        report_result(_engine(json.loads(args._engine)))
        return

    from vllm_specrl.fixtures import fixture_target
    from vllm_specrl.trainer.offline import default_prompts

    model = str(args.model or fixture_target(args.fixture, args.fixtures))
    draft = args.draft or Path(".fixtures/real/drafts/warm-arithmetic")
    if not (draft / "config.json").exists():
        sys.exit(f"no draft at {draft}: run `make draft` or pass --draft")
    base = {"model": model, "dtype": args.dtype, "max_model_len": args.max_model_len,
            "batch_sizes": [int(b) for b in args.batch_sizes.split(",")], "tokens": args.tokens,
            "waves": args.waves, "logprobs": args.logprobs,
            "prompts": default_prompts(32, seed=4321, task=args.prompt_set)}
    configs = [("plain", None, {}, None)]
    ks = [int(k) for k in args.ks.split(",")]
    for sampling in [m for m in args.sampling.split(",") if m and m != "none"]:
        for k in ks:
            spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k,
                    "draft_sample_method": "probabilistic"}
            env = {"fast": {}, "stock": {"VLLM_SPECRL_FAST_SAMPLING": "0"},
                   "lazy": {"VLLM_SPECRL_ONE_PASS_VERIFY": "0"},
                   "eager": {"VLLM_SPECRL_LAZY_REJECTION": "0"},
                   "fullvocab": {"VLLM_SPECRL_DRAFT_VOCAB_SAMPLING": "0"},
                   "spread": {"VLLM_SPECRL_COMPACT_DRAFT_PROBS": "0"}}[sampling]
            configs.append((f"eagle3_k{k}_{sampling}", spec, env, None))
    if args.parallel_draft:
        for k in ks:
            spec = {"method": "eagle3", "model": str(args.parallel_draft), "num_speculative_tokens": k,
                    "draft_sample_method": "probabilistic", "parallel_drafting": True}
            configs.append((f"eagle3_k{k}_parallel", spec, {}, None))
    if args.adaptive:
        spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": max(ks),
                "draft_sample_method": "probabilistic"}
        configs.append((f"eagle3_adaptive_k{max(ks)}", spec, {}, SCHEDULER_CLS))
    held_drafts = [("", draft, {})] + ([("_parallel", args.parallel_draft, {"parallel_drafting": True})]
                                        if args.parallel_draft else [])
    for held in [int(k) for k in args.held_at.split(",") if k]:
        for suffix, held_draft, extra in held_drafts:
            if extra and held not in (0, max(ks)):
                continue  # a parallel drafter serves only 0 and the k it was started with
            spec = {"method": "eagle3", "model": str(held_draft), "num_speculative_tokens": max(ks),
                    "draft_sample_method": "probabilistic",
                    "num_speculative_tokens_per_batch_size": [[1, 1024, held]], **extra}
            configs.append((f"eagle3_k{max(ks)}{suffix}_held_at_{held}", spec, {}, None))
            if held == 0:
                # vLLM's own k = 0 path beside it: the drafter's KV-sync pass on every step.
                configs.append((f"eagle3_k{max(ks)}{suffix}_held_at_0_stock_kv_sync", spec,
                                {"VLLM_SPECRL_DEFER_DRAFT_KV": "0"}, None))
    modes = [m for m in args.compile.split(",") if m]
    if set(modes) - {"eager", "compiled"}:
        sys.exit(f"--compile takes eager and/or compiled, not {args.compile}")
    configs = [(name + ("_compiled" if m == "compiled" else ""), spec, env, sched, m == "compiled")
               for name, spec, env, sched in configs for m in modes]
    report = {"benchmark": "step_cost", "model": model, "draft": str(draft),
              "host": host_info(),
              "settings": {k: v for k, v in base.items() if k != "prompts"}
              | {"temperature": 1.0, "intel_openmp_preloaded": not args.no_iomp},
              "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plain: dict[tuple[int, bool], dict] = {}  # (batch size, compiled): the plain row in the same mode
    for round_index, (name, spec, env, scheduler_cls, compiled) in ((r, c) for r in range(args.rounds)
                                                                    for c in configs):
        if args.rounds > 1:
            name = f"{name}#{round_index}"
        print(f"[step-cost] {name}", flush=True)
        res = run_engine(dict(base, speculative_config=spec, scheduler_cls=scheduler_cls, compiled=compiled), env,
                         args.timeout,
                         iomp=not args.no_iomp)
        if isinstance(res, str):
            print(f"[step-cost]   FAILED: {res[-600:]}", flush=True)
            report["rows"].append({"name": name, "error": res})
            continue
        for row in res:
            row["name"] = name
            row["compiled"] = compiled
            if name.split("#")[0].removesuffix("_compiled") == "plain":
                plain[(row["batch_size"], compiled)] = row
            elif (row["batch_size"], compiled) in plain:
                ref = plain[(row["batch_size"], compiled)]
                row["step_cost_vs_plain"] = row["ms_per_step"]["step"] / ref["ms_per_step"]["step"]
                row["throughput_ratio_vs_plain"] = row["tokens_per_s"] / ref["tokens_per_s"]
            report["rows"].append(row)
            acc = (row.get("spec_decode") or {}).get("acceptance_length")
            print(f"[step-cost]   b={row['batch_size']:>2} step {row['ms_per_step']['step']:.1f} ms"
                  + (f" ({row['step_cost_vs_plain']:.2f} plain)" if "step_cost_vs_plain" in row else "")
                  + (f" accept len {acc:.2f}" if acc else "")
                  + (f" tok/s ratio {row['throughput_ratio_vs_plain']:.2f}" if "throughput_ratio_vs_plain" in row
                     else ""), flush=True)
        args.out.write_text(json.dumps(report, indent=2))
    report["table_markdown"] = table(report)
    args.out.write_text(json.dumps(report, indent=2))
    print(report["table_markdown"])


if __name__ == "__main__":
    main()
