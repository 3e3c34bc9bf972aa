"""Rollout-history proposer vs plain, ngram (and optionally EAGLE-3) on a GRPO-shaped workload.

Each epoch samples G completions (``SamplingParams(n=G)``, T=1 by default) of the same P prompts,
as a GRPO step does, and the same prompts come back every epoch, as they do across RL
epochs. Every method runs in its own engine (one per process) on the same workload, one
after the other; ratios are tokens/s against plain from this run. Served acceptance comes
from vLLM's own ``vllm:spec_decode_*`` counters, per epoch (epoch 0 has no earlier
rollouts: only siblings and the request's own text to draft from).

``--interleave`` keeps every method's engine alive (each in its process) and runs epoch by
epoch in turn, the first method rotating each epoch, so every method's epoch e is timed in
the same minute of the host: on a 2-core VM one engine's speed drifts between epochs by
more than the effect measured at one and four sequences.

    python scripts/bench/bench_history.py --out benchmarks/cpu/bench_history.json
    python scripts/bench/bench_history.py --prompts 1 --max-num-seqs 1 --interleave --out b1.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench_engine import host_info, report_result, run_engine_subprocess  # noqa: E402

HISTORY = "vllm_specrl.proposer.history.HistoryProposer"
# The history proposer's variants: the default (sampled drafts, cost-aware threshold), token-id
# drafts, and the fixed threshold (min_confidence, 0.25 unless --history-config says otherwise).
HISTORY_KNOBS = {"history": {}, "history_ids": {"sample_drafts": False}, "history_fixed": {"cost_aware": False}}


def speculative_config(method: str, k: int, draft: str | None) -> dict | None:
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "suffix":  # vLLM's SuffixDecoding (needs arctic-inference: scripts/bench/build_arctic_suffix.sh)
        return {"method": "suffix", "num_speculative_tokens": k}
    if method in HISTORY_KNOBS:
        return {"method": "custom_class", "model": HISTORY, "num_speculative_tokens": k}
    if method == "eagle3":
        return {"method": "eagle3", "model": draft, "num_speculative_tokens": k,
                "draft_sample_method": "probabilistic"}
    raise ValueError(f"unknown method {method!r}")


def _engine(cfg: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_specrl import metrics

    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=True, seed=cfg["seed"],
              max_model_len=1024, max_num_seqs=cfg["max_num_seqs"], disable_log_stats=False,
              speculative_config=cfg["speculative_config"], additional_config=cfg.get("additional_config") or {},
              worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension")
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in cfg["prompts"]]
    llm.generate(["warm-up"], SamplingParams(max_tokens=8, temperature=1.0), use_tqdm=False)

    def run_epoch(epoch: int) -> dict:
        # No per-request seed: vLLM seeds the children of n=G as seed + i, so epoch e + 1 would
        # repeat e's samples shifted by one child (seen here: a replay acceptance length of 3.5).
        params = SamplingParams(n=cfg["group"], temperature=cfg["temperature"], max_tokens=cfg["max_tokens"])
        before = metrics.from_llm_metrics(llm.get_metrics())
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        stats = metrics.from_llm_metrics(llm.get_metrics()).minus(before).summary() \
            if cfg["speculative_config"] else None
        result = {"epoch": epoch, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                  "spec_decode": stats}
        if cfg.get("save_rollouts"):
            result["rollouts"] = [[list(o.prompt_token_ids), list(c.token_ids)] for o in outs for c in o.outputs]
        return result

    def proposer_state() -> dict | None:
        return llm.collective_rpc("specrl_proposer_state")[0]

    if cfg.get("interleave"):  # the parent sends {"epoch": e} in turn with the other engines, then {"state": 1}
        from bench_engine import serve_commands

        def command(c: dict) -> dict | None:
            if "epoch" in c:  # after another engine's turn: a few tokens warm this one's caches, untimed
                llm.generate(["Warm up again."], SamplingParams(max_tokens=REWARM_TOKENS), use_tqdm=False)
                return run_epoch(c["epoch"])
            return proposer_state()

        serve_commands(command)
        return None
    epochs = [run_epoch(epoch) for epoch in range(cfg["epochs"])]
    return {"epochs": epochs, "proposer": proposer_state()}


REWARM_TOKENS = 16


def run_interleaved(cfgs: dict[str, dict], env: dict[str, str], epochs: int, log_dir: Path) -> dict:
    """Every method's engine alive at once; epoch e runs on each in turn, the first rotating by one."""
    from bench_engine import EngineProcess, engines_alive, in_turns

    def start(method: str):
        return lambda: EngineProcess(__file__, dict(cfgs[method], interleave=True), env,
                                     str(log_dir / f"engine_{method}.log"), 1800)

    runs: dict = {}
    announce = lambda method: print(f"[bench] starting {method}", file=sys.stderr, flush=True)  # noqa: E731
    with engines_alive({method: start(method) for method in cfgs}, announce) as procs:
        t0 = time.perf_counter()
        for method, epoch, result in in_turns(procs, epochs, lambda method, epoch: {"epoch": epoch}):
            if isinstance(result, str):
                runs[method] = result
                continue
            runs.setdefault(method, {"epochs": []})["epochs"].append(result)
            print(f"[bench] epoch {epoch} {method}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
        for method, proc in procs.items():
            if not isinstance(proc, str):
                runs[method]["proposer"] = proc.request({"state": 1})
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--_engine", help=argparse.SUPPRESS)
    ap.add_argument("--fixtures", default=os.environ.get("VLLM_SPECRL_FIXTURES", str(REPO / ".fixtures")))
    ap.add_argument("--model", help="target model directory (default: the real fixture)")
    ap.add_argument("--draft", help="EAGLE-3 draft for the eagle3 method (default: the demo draft)")
    ap.add_argument("--methods", default="plain,ngram,history",
                    help="plain, ngram, suffix, history (sampled drafts, cost-aware threshold), history_ids (token-id "
                         "drafts), history_fixed (the fixed min_confidence), eagle3")
    ap.add_argument("--task", default="explain", choices=["explain", "arithmetic"])
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts per epoch (P)")
    ap.add_argument("--group", type=int, default=4, help="completions per prompt (G)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="concurrent sequences (default: P x G, the whole epoch at once); 1 or 4 for the tail")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--history-config", default=None, help="JSON knobs for the history proposer")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--arctic-site", default=os.environ.get("ARCTIC_SITE"),
                    help="directory arctic-inference was installed into (--target), for the suffix method; "
                         "kept off the default path so its vLLM plugin never loads elsewhere")
    ap.add_argument("--interleave", action="store_true",
                    help="every method's engine alive at once, epochs taken in turn (the first rotating)")
    ap.add_argument("--out", default="results/bench_history.json")
    args = ap.parse_args()
    if args._engine:
        report_result(_engine(json.loads(args._engine)))
        return

    from vllm_specrl.fixtures import build_fixtures, fixture_target
    from vllm_specrl.rl.tasks import make_tasks
    from vllm_specrl.launcher import cpu_env

    if args.model is None:
        build_fixtures(Path(args.fixtures), ("real",))
    model = args.model or str(fixture_target("real", Path(args.fixtures)))
    draft = args.draft or str(Path(args.fixtures) / "real" / "drafts" / "demo-explain")
    prompts = [p for p, _ in make_tasks(0, args.prompts, args.seed, args.task)]
    history_knobs = json.loads(args.history_config) if args.history_config else None
    env = cpu_env(kv_cache_gib=2)  # VLLM_PLUGINS=specrl,...: an installed arctic-inference plugin stays off
    if args.arctic_site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.arctic_site, env.get("PYTHONPATH")]))
    report = {"benchmark": "history_proposer", "host": host_info(),
              "settings": {**vars(args), "model": model, "_engine": None},
              "prompts": prompts, "runs": {}}
    cfgs = {}
    for method in args.methods.split(","):
        knobs = dict(history_knobs or {}, **HISTORY_KNOBS.get(method, {}))
        cfgs[method] = {
            "model": model, "dtype": args.dtype, "seed": args.seed, "prompts": prompts, "group": args.group,
            "epochs": args.epochs, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "max_num_seqs": args.max_num_seqs or args.prompts * args.group, "save_rollouts": method == "plain",
            "speculative_config": speculative_config(method, args.k, draft),
            "additional_config": {"specrl": {"history": knobs}} if knobs else None}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.interleave:
        import tempfile

        log_dir = Path(tempfile.mkdtemp(prefix="bench_history_"))
        print(f"[bench] engine logs: {log_dir}", file=sys.stderr)
        report["runs"] = run_interleaved(cfgs, env, args.epochs, log_dir)
    for method, cfg in ({} if args.interleave else cfgs).items():
        t0 = time.perf_counter()
        result = run_engine_subprocess(__file__, cfg, env, timeout_s=3600)
        print(f"{method}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        report["runs"][method] = result
    for method, result in report["runs"].items():
        if isinstance(result, str):
            print(f"{method}: {result}", file=sys.stderr)
    add_comparisons(report)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["comparison"], indent=1))


def add_comparisons(report: dict) -> None:
    """Per method and epoch: tokens/s against plain, and vLLM's acceptance counters."""
    plain = report["runs"].get("plain")
    table = {}
    for method, run in report["runs"].items():
        if isinstance(run, str) or method == "plain" or isinstance(plain, str) or plain is None:
            continue
        rows = []
        for mine, base in zip(run["epochs"], plain["epochs"]):
            sd = mine["spec_decode"] or {}
            rows.append({"epoch": mine["epoch"], "speedup": mine["tokens_per_s"] / base["tokens_per_s"],
                         "acceptance_length": sd.get("acceptance_length"),
                         "accepted_per_pos": sd.get("per_position_acceptance"),
                         "accepted_share": (sd.get("num_accepted_tokens") or 0) / max(mine["tokens"], 1),
                         "drafts": sd.get("num_drafts"), "draft_tokens": sd.get("num_draft_tokens")})
        total = sum(e["tokens"] for e in run["epochs"]) / sum(e["wall_s"] for e in run["epochs"])
        base_total = sum(e["tokens"] for e in plain["epochs"]) / sum(e["wall_s"] for e in plain["epochs"])
        table[method] = {"speedup_all_epochs": total / base_total, "epochs": rows}
    report["comparison"] = table


if __name__ == "__main__":
    main()
