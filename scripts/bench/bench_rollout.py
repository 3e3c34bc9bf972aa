"""Rollout throughput of vLLM on a fixture: plain vs speculative methods, in one run.

A sweep over methods (plain, ngram, EAGLE-3 with a random draft, EAGLE-3 with a
warm-started draft), k (num_speculative_tokens), temperature and batch size.
One engine per (method, k), each in its own subprocess (vLLM allows one engine
per process), started once and then measured at every (temperature, batch
size): ``batch`` concurrent sequences are generated in ``--waves`` waves of
``batch`` requests, each ending at EOS or ``--max-tokens`` as an RL rollout does, so
``batch`` sequences decode together; with ``--refill`` the same requests are kept
``batch`` in flight, the next starting as soon as one ends (a rollout server's queue),
so a speculative wave's sequences, which end steps apart, do not leave a partial
batch at the end of every wave. Every speculative cell is reported as a ratio against the
plain cell of the same temperature and batch size from this run, with vLLM's
acceptance counters (``vllm:spec_decode_*``) and the per-step cost that
explains the ratio: ``step_cost_vs_plain = acceptance_length / ratio`` (a
speculative step -- draft k tokens, verify k+1 -- in units of one plain
decode step), so ``ratio = acceptance_length / step_cost_vs_plain``.
Lengths are natural by default, as rollouts end: past EOS a model writes text no rollout holds and
no draft was trained on, where a draft accepts less, so fixed lengths (``--ignore-eos``: every
answer exactly ``--max-tokens``, the same token count in every engine) read a lower acceptance
than RL serves.

Modes: ``offline`` (``vllm.LLM`` in-process engine) or ``server`` (``vllm
serve`` with the plugin and ``batch`` concurrent OpenAI requests, as RL
frameworks drive rollout servers). Output: a JSON file and a PNG next to it.
``--rounds N`` runs every engine N times in turn (plain, each method, plain again,
...): on 2 cores two engines doing the same work read apart in one run by more than many
effects measured, so each cell's ratio is reported per round and pooled over rounds (``pooled``).
``--interleave S`` keeps a round's engines alive together and measures each cell S times on each,
one engine after another: the same engine's speed drifts over a minute on a shared VM, and
engines measured one after another take that drift into their ratio; interleaved, every method sees it.

    python scripts/bench/bench_rollout.py --fixture real            # the full sweep
    python scripts/bench/bench_rollout.py --methods plain,ngram --ks 3 --batch-sizes 4

``mtp`` serves the policy's own MTP layer (``"method": "mtp"``) on ``--mtp-model``
(default: the ``real-mimo`` fixture, SmolLM2 re-labelled as MiMo with a trained MTP
layer: ``vllm-specrl fixtures --only real-mimo``); its body computes SmolLM2's
function, so the ratios are against the same ``plain`` engine, and ``plain-mimo`` (no
speculation on the MTP target) shows what the re-labelled body itself costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from vllm_specrl.adaptive import SCHEDULER_CLS
from bench_engine import host_info

METHODS = ("plain", "ngram", "eagle3-random", "eagle3-warm", "eagle3-warm-adaptive", "mtp", "plain-mimo")
# Methods served on the MTP target (--mtp-model: SmolLM2 re-labelled as MiMo with its own MTP layer;
# the body computes exactly SmolLM2's function, so "plain" stays the reference and "plain-mimo" shows it).
MTP_TARGET_METHODS = ("mtp", "plain-mimo")
SINGLE_ENGINE_METHODS = ("plain", "plain-mimo", "eagle3-warm-adaptive")
ADAPTIVE_SCHEDULER = SCHEDULER_CLS


def make_prompts(n: int, prompt_set: str = "code", exclude: set[str] | None = None) -> list[str]:
    """``code``: short coding requests. ``chat``/``arithmetic``: an offline warm start's task
    family with other numbers, minus ``exclude`` (the prompts a draft was trained on): in-domain,
    held-out prompts, as an RL run warm-starts on its own task's prompts. ``explain``: the RL demo's
    own prompts (its task has 81), which ``make demo``'s draft is warm-started on and an RL run
    samples again every epoch: not held out, the rollouts a warm draft serves in RL."""
    if prompt_set in ("chat", "arithmetic", "explain"):
        from vllm_specrl.trainer.offline import default_prompts

        if prompt_set == "explain":
            return default_prompts(n, seed=1234, task="explain")
        pool = [p for p in default_prompts(4 * n + 64, seed=1234, task=prompt_set) if p not in (exclude or set())]
        return pool[:n]
    topics = ["a binary search", "a stack", "reading a CSV file", "a retry loop",
              "merging two dicts", "a tiny HTTP client", "a prime sieve", "an LRU cache"]
    return [f"Write a short Python function for {topics[i % len(topics)]} (variant {i})."
            for i in range(n)]


def speculative_config(method: str, k: int, drafts: dict[str, str]) -> dict | None:
    if method in ("plain", "plain-mimo"):
        return None
    if method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": k, "draft_sample_method": "probabilistic"}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    return {"method": "eagle3", "model": drafts[method.removesuffix("-adaptive")], "num_speculative_tokens": k,
            "draft_sample_method": "probabilistic"}


def cell_jobs(cfg: dict, batch: int, slice_index: int = 0) -> list[tuple[int, int]]:
    """(prompt index, seed) per request: ``samples`` consecutive requests share a prompt; each
    interleaved slice samples the same prompts with its own seeds (the same in every engine)."""
    n = batch * cfg["waves"]
    return [((j // cfg["samples"]) % len(cfg["prompts"]), cfg["seed"] + slice_index * n + j) for j in range(n)]


# Interleaved slices: before each measured cell, a few steps at its batch size, so an engine that just
# waited out another's slice (cold caches, the other engine's pages in the way) does not pay for that in
# its measurement (unwarmed, whichever engine ran right after a switch read a few percent slower).
REWARM_TOKENS = 16


def adaptive_variants(adaptive_config: dict | None, variants: list[dict]) -> dict[str, dict]:
    """``--adaptive-variant``: an adaptive engine name per variant, its knobs over ``--adaptive-config``'s."""
    return {f"eagle3-warm-v{i}-adaptive": {**(adaptive_config or {}), **variant} for i, variant in enumerate(variants)}


def engine_config(base: dict, method: str, k: int, spec: dict | None, variant_configs: dict[str, dict],
                  mtp_model: str | None = None) -> dict:
    """One engine's settings: the run's, with its name, speculative config, target, scheduler and
    adaptive-k knobs (a variant's own, else the run's)."""
    return dict(base, name=method if method == "plain" else f"{method}_k{k}", speculative_config=spec,
                adaptive_config=variant_configs.get(method, base["adaptive_config"]),
                model=mtp_model if method in MTP_TARGET_METHODS else base["model"],
                scheduler_cls=ADAPTIVE_SCHEDULER if method.endswith("-adaptive") else None)


def _drive(cfg: dict, run_cells) -> list[dict] | None:
    """Measure once and return the cells, or, with ``--interleave``, measure one slice per command
    from the parent until it says quit (``bench_engine.serve_commands``)."""
    if cfg.get("interleave"):
        from bench_engine import serve_commands

        serve_commands(run_cells)
        return None
    return run_cells({})


# --- one engine, run in a subprocess ---------------------------------------------

def _engine_offline(cfg: dict) -> list[dict] | None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    spec = cfg["speculative_config"]
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=not cfg.get("compile"), seed=cfg["seed"],
              max_model_len=cfg["max_model_len"], max_num_seqs=max(cfg["batch_sizes"]),
              speculative_config=spec, disable_log_stats=False,
              additional_config=({"specrl": {"adaptive_k": cfg["adaptive_config"]}} if cfg.get("adaptive_config")
                                 else {}),
              **({"scheduler_cls": cfg["scheduler_cls"]} if cfg.get("scheduler_cls") else {}))
    if cfg.get("phases"):
        from phase_timers import install_phase_timers

        llm.collective_rpc(lambda worker: install_phase_timers(worker.model_runner) and None)
        _time_scheduler(llm)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True) for p in cfg["prompts"]]
    for temperature in cfg["temperatures"]:  # warm-up, each sampling path once
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=temperature, seed=0),
                     use_tqdm=False)
    for batch in cfg["batch_sizes"] if cfg["warmup_steps"] else ():
        # Every engine, measured or not: an adaptive-k engine calibrates here, as a rollout server
        # does over its first steps (its exploration after this is part of every measured cell).
        # Exactly `batch` sequences (prompts repeat when there are fewer), so the warm-up reaches
        # the batch size the cell measures.
        llm.generate([prompts[-1 - i % len(prompts)] for i in range(batch)],
                     [SamplingParams(max_tokens=cfg["warmup_steps"], temperature=1.0, ignore_eos=True,
                                     seed=1 + i) for i in range(batch)], use_tqdm=False)

    def run_cells(command: dict) -> list[dict]:
        cells = []
        for temperature in cfg["temperatures"]:
            for batch in cfg["batch_sizes"]:
                if command.get("rewarm"):
                    llm.generate(prompts[:1] * batch, [SamplingParams(max_tokens=REWARM_TOKENS, temperature=temperature,
                                                                      ignore_eos=True, seed=i) for i in range(batch)],
                                 use_tqdm=False)
                cells.append(_offline_cell(cfg, llm, prompts, temperature, batch, command.get("slice", 0)))
        return cells

    return _drive(cfg, run_cells)


SCHEDULER_PHASES = ("schedule", "update_from_output")


def _time_scheduler(llm) -> None:
    """Time the in-process engine core's scheduler calls (adaptive k runs inside them)."""
    from phase_timers import in_process_scheduler, timed_into

    scheduler = in_process_scheduler(llm)
    totals = llm._bench_scheduler_seconds = dict.fromkeys(SCHEDULER_PHASES, 0.0)
    for name in SCHEDULER_PHASES:
        setattr(scheduler, name, timed_into(totals, name, getattr(scheduler, name)))


def _phase_totals(llm) -> dict:
    """Seconds so far in each phase of the model runner (``phase_timers.install_phase_timers``) and the
    scheduler, and the drafter's deferred draft-KV counters where it has them."""
    from vllm_specrl.cpu.deferred_draft_kv import deferred_draft_kv_counters

    def read(worker):
        totals = dict(worker.model_runner._specrl_phase_totals)
        totals.update({f"deferred_{k}": v for k, v in (deferred_draft_kv_counters(worker) or {}).items()
                       if k != "rows_held"})
        return totals
    return {**llm.collective_rpc(read)[0], **llm._bench_scheduler_seconds}


def _offline_cell(cfg: dict, llm, prompts: list[str], temperature: float, batch: int, slice_index: int) -> dict:
    from vllm import SamplingParams

    from vllm_specrl import metrics
    from vllm_specrl.adaptive import state as adaptive_state

    spec = cfg["speculative_config"]
    jobs = cell_jobs(cfg, batch, slice_index)
    phases_before = _phase_totals(llm) if cfg.get("phases") else None
    before = metrics.from_llm_metrics(llm.get_metrics())
    k_before = (adaptive_state.read() or {}).get("chosen_k_counts")
    tokens, t0 = 0, time.perf_counter()

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_tokens=cfg["max_tokens"],
                              ignore_eos=cfg["ignore_eos"], seed=seed)

    if cfg.get("refill"):
        tokens = _run_refilled(llm.llm_engine, [(prompts[i], params(seed)) for i, seed in jobs], batch)
    else:
        for w in range(0, len(jobs), batch):
            wave = jobs[w:w + batch]
            outs = llm.generate([prompts[i] for i, _ in wave], [params(seed) for _, seed in wave],
                                use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    wall = time.perf_counter() - t0
    stats = metrics.from_llm_metrics(llm.get_metrics()).minus(before).summary()
    cell = _cell(temperature, batch, len(jobs), tokens, wall, stats if spec else None)
    if phases_before is not None:
        from phase_timers import PHASES

        after = _phase_totals(llm)
        seconds = PHASES + SCHEDULER_PHASES
        cell["phases_s"] = {k: round(after[k] - phases_before[k], 4) for k in seconds}
        cell["phases_s"]["outside_runner"] = round(wall - cell["phases_s"]["step"], 4)
        cell["phase_counts"] = {k: after[k] - phases_before[k] for k in after if k not in seconds}
    if cfg.get("scheduler_cls"):
        state = adaptive_state.read() or {}
        cell["adaptive_k"] = chosen_k(k_before, state.get("chosen_k_counts"))
        cell["adaptive_k"]["controller"] = state
    return cell


def _run_refilled(engine, requests: list[tuple[str, object]], batch: int) -> int:
    """Generate ``requests`` with ``batch`` in flight at every step: the next one is added as soon as
    one finishes, as a rollout server's queue does. Waves instead wait for their slowest sequence,
    and speculation makes a wave's sequences end steps apart (plain ones end together), so
    waves of a few sequences charge speculation a partial batch at the end of every wave."""
    queue, in_flight, tokens = list(enumerate(requests)), 0, 0
    while queue or engine.has_unfinished_requests():
        while queue and in_flight < batch:
            j, (prompt, params) = queue.pop(0)
            engine.add_request(f"bench-refill-{j}-{time.monotonic_ns()}", prompt, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                in_flight -= 1
    return tokens


def chosen_k(before: list[int] | None, after: list[int] | None) -> dict | None:
    """Steps per k the adaptive controller scheduled between two snapshots, and their mean."""
    if not after:
        return None
    counts = [a - b for a, b in zip(after, before or [0] * len(after))]
    total = sum(counts)
    return {"steps_per_k": counts, "mean_k": sum(k * n for k, n in enumerate(counts)) / total if total else None}


def _engine_server(cfg: dict) -> list[dict] | None:
    from concurrent.futures import ThreadPoolExecutor

    import requests
    from openai import OpenAI

    from vllm_specrl import metrics
    from vllm_specrl.launcher import VLLMServer

    spec = cfg["speculative_config"]
    extra = ["--dtype", cfg["dtype"], "--max-model-len", str(cfg["max_model_len"]),
             "--max-num-seqs", str(max(cfg["batch_sizes"])), "--seed", str(cfg["seed"])]
    if cfg.get("scheduler_cls"):
        extra += ["--scheduler-cls", cfg["scheduler_cls"]]
    if cfg.get("adaptive_config"):
        extra += ["--additional-config", json.dumps({"specrl": {"adaptive_k": cfg["adaptive_config"]}})]
    if spec:
        extra += ["--speculative-config", json.dumps(spec)]
    log = Path(cfg["log_dir"]) / f"server_{cfg['name']}.log"
    with VLLMServer(cfg["model"], extra, log_path=log, enforce_eager=not cfg.get("compile"),
                    startup_timeout_s=900 if cfg.get("compile") else 300) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none")
        model = client.models.list().data[0].id

        def one(job, temperature, max_tokens=None):
            i, seed = job
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": cfg["prompts"][i]}],
                temperature=temperature, max_tokens=max_tokens or cfg["max_tokens"], seed=seed,
                logprobs=True, extra_body={"ignore_eos": cfg["ignore_eos"]})
            return r.usage.completion_tokens

        def counters():
            return metrics.from_prometheus_text(requests.get(srv.url + "/metrics", timeout=30).text)

        def engine_state() -> dict | None:
            """What the speculative engine did beside its counters: deferred draft-KV rows, adaptive k."""
            if not spec:
                return None
            st = requests.get(srv.url + "/specrl/status", timeout=60).json()
            workers = st.get("workers") or [{}]
            ak = st.get("adaptive_k") or {}
            return {"deferred_draft_kv": workers[0].get("deferred_draft_kv"),
                    "adaptive_k": {key: ak.get(key) for key in ("chosen_k_counts", "explored_steps", "buckets")}}

        one((0, 0), 0.0)  # warm-up
        if cfg.get("calibrate"):  # the start-up sweep a rollout server runs (`make demo` does); plain: a warm-up
            from vllm_specrl.adaptive.k_sweep import calibrate

            calibrate(srv.url, model, max_batch=max(cfg["batch_sizes"]), seed=cfg["seed"])

        def run_cells(command: dict) -> list[dict]:
            cells = []
            for temperature in cfg["temperatures"]:
                for batch in cfg["batch_sizes"]:
                    if command.get("rewarm"):
                        with ThreadPoolExecutor(batch) as pool:
                            list(pool.map(lambda i: one((0, i), temperature, REWARM_TOKENS), range(batch)))
                    jobs = cell_jobs(cfg, batch, command.get("slice", 0))
                    before, tokens, t0 = counters(), 0, time.perf_counter()
                    with ThreadPoolExecutor(batch) as pool:
                        if cfg.get("refill"):  # the pool's `batch` threads keep `batch` requests in flight
                            tokens = sum(pool.map(lambda j: one(j, temperature), jobs))
                        else:
                            for w in range(0, len(jobs), batch):
                                tokens += sum(pool.map(lambda j: one(j, temperature), jobs[w:w + batch]))
                    wall = time.perf_counter() - t0
                    stats = counters().minus(before).summary()
                    cells.append(_cell(temperature, batch, len(jobs), tokens, wall, stats if spec else None))
                    cells[-1]["engine_state"] = engine_state()
            return cells

        return _drive(cfg, run_cells)


def _cell(temperature: float, batch: int, requests: int, tokens: int, wall: float,
          spec_decode: dict | None) -> dict:
    return {"temperature": temperature, "batch_size": batch, "requests": requests, "tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": tokens / wall, "spec_decode": spec_decode}


def engine_env() -> dict[str, str]:
    from vllm_specrl.launcher import with_intel_openmp

    env = with_intel_openmp(dict(os.environ))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_PLUGINS", "specrl,specrl_http")
    return env


def run_engine_in_subprocess(cfg: dict, timeout_s: float) -> list[dict] | str:
    from bench_engine import run_engine_subprocess

    return run_engine_subprocess(__file__, cfg, engine_env(), timeout_s)


def run_interleaved(engines: list[tuple], cfgs: list[dict], args: argparse.Namespace,
                    rnd: int) -> Iterator[tuple[tuple, int, list[dict] | str]]:
    """``--interleave``: the round's engines started one after another and kept alive, then every
    slice measured on each in turn, the order rotating by one each slice (no engine always
    measured first or right after another's start-up)."""
    from bench_engine import EngineProcess, engines_alive, in_turns

    by_name = {cfg["name"]: (engine, cfg) for engine, cfg in zip(engines, cfgs)}

    def start(cfg: dict):
        log = Path(cfg["log_dir"]) / f"engine_{cfg['name']}_r{rnd}.log"
        return lambda: EngineProcess(__file__, dict(cfg, interleave=True), engine_env(), str(log), args.engine_timeout)

    def announce(name: str) -> None:
        spec = by_name[name][1]["speculative_config"]
        print(f"[bench] starting {name} (round {rnd + 1}/{args.rounds}, interleaved): "
              f"{json.dumps(spec) if spec else 'no speculation'}", flush=True)

    def command(name: str, slice_index: int) -> dict:
        print(f"[bench] {name} slice {slice_index + 1}/{args.interleave}", flush=True)
        return {"slice": slice_index, "rewarm": True}

    with engines_alive({cfg["name"]: start(cfg) for cfg in cfgs}, announce) as procs:
        for name, slice_index, result in in_turns(procs, args.interleave, command):
            yield by_name[name][0], slice_index, result


# --- drafts, ratios, plot ------------------------------------------------------------

def prepare_drafts(args: argparse.Namespace, model: str, methods: list[str]) -> dict[str, str]:
    """The random and warm-started EAGLE-3 drafts the sweep needs (built when missing)."""
    drafts: dict[str, str] = {}
    warm = Path(args.warm_draft or args.out.parent / "drafts" / f"{args.fixture}-warm")
    vocab = args.draft_vocab_size
    if "eagle3-warm" in methods or "eagle3-warm-adaptive" in methods:
        if not (warm / "config.json").exists():
            print(f"[bench] warm-starting a draft into {warm} (vllm-specrl train-draft --offline)",
                  flush=True)
            subprocess.run([sys.executable, "-m", "vllm_specrl.cli", "train-draft", "--offline",
                            "--target", model, "--draft", str(warm), "--dtype", args.dtype,
                            "--log", str(warm.with_suffix(".jsonl"))]
                           + (["--draft-vocab-size", str(vocab)] if vocab else []),
                           check=True, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
        drafts["eagle3-warm"] = str(warm)
        vocab = vocab or json.loads((warm / "config.json").read_text()).get("draft_vocab_size")
    if "eagle3-random" in methods:
        from vllm_specrl.proposer.checkpoint import init_draft

        rand = args.out.parent / "drafts" / f"{Path(model).parent.name}-random-v{vocab or 'full'}"
        if not (rand / "config.json").exists():
            init_draft(model, rand, vocab, seed=0)  # same shape as the warm draft: same cost
        drafts["eagle3-random"] = str(rand)
    return drafts


def add_ratios(cells: list[dict]) -> None:
    """Each speculative cell against the plain cell of the same round, slice, temperature and batch size."""
    plain = {(c.get("round", 0), c.get("slice", 0), c["temperature"], c["batch_size"]): c["tokens_per_s"]
             for c in cells if c["method"] == "plain" and "error" not in c}
    for c in cells:
        base = plain.get((c.get("round", 0), c.get("slice", 0), c.get("temperature"), c.get("batch_size")))
        if c["method"] == "plain" or "error" in c or not base:
            continue
        c["throughput_ratio_vs_plain"] = c["tokens_per_s"] / base
        length = (c["spec_decode"] or {}).get("acceptance_length")
        if length:
            c["step_cost_vs_plain"] = length / c["throughput_ratio_vs_plain"]


def pool_rounds(cells: list[dict]) -> list[dict]:
    """One row per (method, k, temperature, batch size) over every round (and interleaved slice):
    tokens and wall time summed (the pooled ratio against plain's pooled rate), acceptance from the
    summed counters, and each round's or slice's own ratio (its spread is what one run of engines
    cannot resolve)."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        if "error" not in c:
            groups.setdefault((c["method"], c["k"], c["temperature"], c["batch_size"]), []).append(c)
    rows = []
    for (method, k, temperature, batch), group in groups.items():
        tokens, wall = sum(c["tokens"] for c in group), sum(c["wall_s"] for c in group)
        row = {"method": method, "k": k, "temperature": temperature, "batch_size": batch,
               "rounds": len(group), "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": tokens / wall,
               "round_ratios": [round(c["throughput_ratio_vs_plain"], 4) for c in group
                                if "throughput_ratio_vs_plain" in c]}
        specs = [c["spec_decode"] for c in group if c.get("spec_decode")]
        if specs:
            drafts = sum(sd["num_drafts"] for sd in specs)
            accepted = sum(sd["num_accepted_tokens"] for sd in specs)
            row["spec_decode"] = {"num_drafts": drafts, "num_accepted_tokens": accepted,
                                  "acceptance_length": 1.0 + accepted / drafts if drafts else None}
        else:
            row["spec_decode"] = None
        ks = [c["adaptive_k"]["steps_per_k"] for c in group if (c.get("adaptive_k") or {}).get("steps_per_k")]
        if ks:
            row["adaptive_k"] = chosen_k(None, [sum(col) for col in zip(*ks)])
        rows.append(row)
    plain = {(r["temperature"], r["batch_size"]): r["tokens_per_s"] for r in rows if r["method"] == "plain"}
    for r in rows:
        base = plain.get((r["temperature"], r["batch_size"]))
        if r["method"] != "plain" and base:
            r["throughput_ratio_vs_plain"] = r["tokens_per_s"] / base
            spread = r["round_ratios"] or [r["throughput_ratio_vs_plain"]]
            r["round_ratio_min"], r["round_ratio_max"] = min(spread), max(spread)
            length = (r["spec_decode"] or {}).get("acceptance_length")
            if length:
                r["step_cost_vs_plain"] = length / r["throughput_ratio_vs_plain"]
    return rows


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in report["pooled"] if c["method"] != "plain"]
    temps = sorted({c["temperature"] for c in cells})
    fig, axes = plt.subplots(len(temps), 2, figsize=(11, 3.6 * len(temps)), squeeze=False)
    styles = ["-", "--", ":", "-."]
    colors = {"ngram": "tab:orange", "eagle3-random": "tab:gray", "eagle3-warm": "tab:blue",
              "eagle3-warm-adaptive": "tab:green", "mtp": "tab:red", "plain-mimo": "tab:brown"}
    spare = iter(["tab:purple", "tab:olive", "tab:cyan", "tab:pink", "tab:red", "tab:brown"])
    for method in sorted({c["method"] for c in cells} - set(colors)):  # custom configs: one colour each
        colors[method] = next(spare, None)
    markers = ["o", "s", "^", "D"]
    batches = sorted({c["batch_size"] for c in cells})
    for row, temp in enumerate(temps):
        for method in sorted({c["method"] for c in cells}):
            for bi, batch in enumerate(batches):
                pts = sorted((c["k"], c.get("throughput_ratio_vs_plain"),
                              (c["spec_decode"] or {}).get("acceptance_length"))
                             for c in cells if c["method"] == method and c["temperature"] == temp
                             and c["batch_size"] == batch)
                if not pts:
                    continue
                ks = [p[0] for p in pts]
                kw = {"color": colors.get(method), "linestyle": styles[bi % len(styles)],
                      "marker": markers[bi % len(markers)],
                      "label": f"{method} b={batch}"}
                axes[row][0].plot(ks, [p[1] for p in pts], **kw)
                axes[row][1].plot(ks, [p[2] for p in pts], **kw)
        axes[row][0].axhline(1.0, color="black", linewidth=0.8)
        axes[row][0].set_title(f"throughput vs plain vLLM, T={temp:g}")
        axes[row][1].set_title(f"acceptance length (tokens per verify), T={temp:g}")
        for ax in axes[row]:
            ax.set_xlabel("k (num_speculative_tokens)")
            ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=7, ncol=2)
    rounds, slices = report["settings"].get("rounds", 1), report["settings"].get("interleave") or 0
    fig.suptitle(f"{report['fixture'] or report['model']} ({report['settings']['dtype']}, "
                 f"{report['host']['cpus']} CPUs, {report['settings']['mode']}"
                 + (f", {rounds} rounds pooled" if rounds > 1 else "")
                 + (f", {slices} interleaved slices" if slices else "") + ")")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--_engine", help=argparse.SUPPRESS)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--fixture", default="real", choices=["real", "tiny"])
    ap.add_argument("--model", default=None, help="target model dir (overrides --fixture)")
    ap.add_argument("--mtp-model", type=Path, default=None,
                    help="target with its own MTP layer for mtp / plain-mimo (default: the real-mimo fixture)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    ap.add_argument("--ks", default="1,2,3,4,5", help="num_speculative_tokens values")
    ap.add_argument("--speculative-config", action="append", default=[],
                    help="extra JSON speculative config to compare (repeatable)")
    ap.add_argument("--adaptive-speculative-config", action="append", default=[],
                    help="extra JSON speculative config served with adaptive k, its k the largest "
                         "(repeatable; e.g. a parallel draft, served at 0 or its k)")
    ap.add_argument("--warm-draft", type=Path, default=None,
                    help="warm-started draft dir (default: <out dir>/drafts/<fixture>-warm, built if missing)")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="draft vocab for drafts built here (default: the warm draft's)")
    ap.add_argument("--mode", default="offline", choices=["offline", "server"])
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--waves", type=int, default=3, help="waves of `batch` requests per cell")
    ap.add_argument("--refill", action="store_true",
                    help="keep `batch` requests in flight (the next starts when one ends, as a rollout "
                         "server's queue does) instead of waves that wait for their slowest sequence")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every engine this many times, in turn (plain, then each method, again): "
                         "ratios per round and pooled, so engine-to-engine noise shows as spread")
    ap.add_argument("--interleave", type=int, default=0, metavar="SLICES",
                    help="start a round's engines together and measure every cell SLICES times, one engine "
                         "after another (the order rotating each slice), so the VM's drift over a run falls "
                         "on every method alike; each slice's ratio is against plain's slice beside it")
    ap.add_argument("--phases", action="store_true",
                    help="offline: time each cell's model-runner phases (target forward, logits, samplers, "
                         "the drafter's proposal), the scheduler's calls (adaptive k runs in them) and the "
                         "time outside the runner, in every engine")
    ap.add_argument("--warmup-steps", type=int, default=96,
                    help="tokens decoded at every batch size before measuring (adaptive k calibrates)")
    ap.add_argument("--calibrate", action="store_true",
                    help="--mode server: run adaptive k's start-up calibration sweep (vllm_specrl.adaptive."
                         "calibrate, what `make demo` runs) on every engine before measuring; plain engines get "
                         "the same requests as a warm-up")
    ap.add_argument("--adaptive-max-k", type=int, default=3, help="k limit of eagle3-warm-adaptive")
    ap.add_argument("--adaptive-config", type=json.loads, default=None,
                    help='adaptive-k knobs as JSON (AdaptiveKConfig), e.g. \'{"elimination_z": 0}\'')
    ap.add_argument("--adaptive-variant", type=json.loads, action="append", default=[],
                    help="another eagle3-warm-adaptive engine (eagle3-warm-v{i}-adaptive) with these adaptive-k "
                         "knobs over --adaptive-config's, e.g. '{\"speculate_margin\": 0}' (repeatable): "
                         "a rule against the default in one run")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-set", default="code", choices=["code", "chat", "arithmetic", "explain"])
    ap.add_argument("--samples", type=int, default=4, help="G samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    lengths = ap.add_mutually_exclusive_group()
    lengths.add_argument("--ignore-eos", action="store_true",
                         help="fixed lengths: every answer runs --max-tokens past its EOS (the same token count "
                              "in every engine, but the text past EOS is no rollout's and drafts accept less there)")
    lengths.add_argument("--stop-at-eos", action="store_true",
                         help="natural lengths, ending at EOS as RL rollouts do (the default)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile", action="store_true",
                    help="every engine in vLLM's torch.compile mode (its default; about a minute more per engine "
                         "start) instead of eager mode, as the project's servers run")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=Path("results/bench_rollout.json"))
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    if args.calibrate and args.mode != "server":
        ap.error("--calibrate sweeps through the server's HTTP API: it needs --mode server")
    if args.phases and args.mode != "offline":
        ap.error("--phases times the model runner in this process: it needs --mode offline")

    if args._engine:
        cfg = json.loads(args._engine)
        cells = (_engine_offline if cfg["mode"] == "offline" else _engine_server)(cfg)
        if cells is not None:
            from bench_engine import report_result

            report_result(cells)
        return

    from vllm_specrl.fixtures import fixture_target

    model = str(args.model or fixture_target(args.fixture, args.fixtures))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    drafts = prepare_drafts(args, model, methods)
    ks = [int(k) for k in args.ks.split(",")]
    engines = [(m, 0, None) for m in ("plain", "plain-mimo") if m in methods]
    engines += [(m, k, speculative_config(m, k, drafts)) for m in methods
                if m not in SINGLE_ENGINE_METHODS for k in ks]
    if "eagle3-warm-adaptive" in methods:
        engines.append(("eagle3-warm-adaptive", args.adaptive_max_k,
                        speculative_config("eagle3-warm-adaptive", args.adaptive_max_k, drafts)))
    variant_configs = adaptive_variants(args.adaptive_config, args.adaptive_variant)
    if variant_configs and "eagle3-warm" not in drafts:
        ap.error("--adaptive-variant serves the warm draft: add eagle3-warm-adaptive to --methods")
    engines += [(name, args.adaptive_max_k, speculative_config("eagle3-warm-adaptive", args.adaptive_max_k, drafts))
                for name in variant_configs]
    engines += [(f"custom{i}", json.loads(s).get("num_speculative_tokens", 0), json.loads(s))
                for i, s in enumerate(args.speculative_config)]
    engines += [(f"custom{i}-adaptive", json.loads(s).get("num_speculative_tokens", 0), json.loads(s))
                for i, s in enumerate(args.adaptive_speculative_config)]
    trained_on: set[str] = set()
    if set(methods) & set(MTP_TARGET_METHODS):
        from vllm_specrl.fixtures import read_manifest

        mtp_model = args.mtp_model or fixture_target("real-mimo", args.fixtures)
        trained_on |= set(read_manifest(mtp_model, verify_hashes=False).metrics.get("train_prompts", []))
    for draft_dir in drafts.values():
        meta = Path(draft_dir) / "trainer_meta.json"
        if meta.is_file():
            trained_on |= set(json.loads(meta.read_text()).get("warm_start", {}).get("train_prompt_texts", []))
    base = {"model": model, "mode": args.mode,
            "prompts": make_prompts(args.prompts, args.prompt_set, trained_on),
            "prompt_set": args.prompt_set,
            "samples": args.samples, "waves": args.waves, "refill": args.refill, "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "temperatures": [float(t) for t in args.temperatures.split(",")],
            "batch_sizes": [int(b) for b in args.batch_sizes.split(",")], "dtype": args.dtype,
            "max_model_len": args.max_model_len, "seed": args.seed, "log_dir": str(args.out.parent),
            "warmup_steps": args.warmup_steps, "adaptive_config": args.adaptive_config,
            "adaptive_variants": variant_configs,
            "rounds": args.rounds, "calibrate": args.calibrate, "interleave": args.interleave,
            "phases": args.phases, "compile": args.compile}
    report = {"benchmark": "rollout_throughput", "model": model,
              "fixture": None if args.model else args.fixture, "drafts": drafts,
              "host": host_info(),
              "settings": {k: v for k, v in base.items() if k not in ("prompts", "log_dir")},
              "cells": []}
    if set(methods) & set(MTP_TARGET_METHODS):
        report["mtp_model"] = str(mtp_model)
    t_start = time.time()

    def engine_cfg(method: str, k: int, spec: dict | None) -> dict:
        return engine_config(base, method, k, spec, variant_configs, report.get("mtp_model"))

    def measured(rnd: int) -> Iterator[tuple[tuple, int, list[dict] | str]]:
        """(engine, slice, its cells or why there are none), in the order measured."""
        if not args.interleave:
            for engine in engines:
                cfg = engine_cfg(*engine)
                print(f"[bench] {cfg['name']}" + (f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else "")
                      + f": {json.dumps(engine[2]) if engine[2] else 'no speculation'}", flush=True)
                yield engine, 0, run_engine_in_subprocess(cfg, args.engine_timeout)
            return
        yield from run_interleaved(engines, [engine_cfg(*e) for e in engines], args, rnd)

    for rnd, (method, k, spec), slice_index, res in ((r, *m) for r in range(args.rounds) for m in measured(r)):
        if isinstance(res, str):
            print(f"[bench]   FAILED: {res[-800:]}", flush=True)
            report["cells"].append({"method": method, "k": k, "round": rnd, "slice": slice_index,
                                    "speculative_config": spec, "error": res})
            continue
        for cell in res:
            report["cells"].append({"method": method, "k": k, "round": rnd, "slice": slice_index,
                                    "speculative_config": spec, **cell})
        add_ratios(report["cells"])
        for cell in report["cells"][-len(res):]:
            sd = cell["spec_decode"] or {}
            print(f"[bench]   T={cell['temperature']:g} b={cell['batch_size']:>2}: "
                  f"{cell['tokens_per_s']:7.1f} tok/s"
                  + (f"  ratio {cell['throughput_ratio_vs_plain']:.2f}"
                     if "throughput_ratio_vs_plain" in cell else "")
                  + (f"  accept len {sd['acceptance_length']:.2f}" if sd.get("acceptance_length") else "")
                  + (f"  step cost {cell['step_cost_vs_plain']:.2f}" if "step_cost_vs_plain" in cell else "")
                  + (f"  mean k {cell['adaptive_k']['mean_k']:.2f}"
                     if (cell.get("adaptive_k") or {}).get("mean_k") is not None else ""),
                  flush=True)
        report["elapsed_s"] = round(time.time() - t_start, 1)
        report["pooled"] = pool_rounds(report["cells"])
        args.out.write_text(json.dumps(report, indent=2))  # partial results survive a stop
    report["pooled"] = pool_rounds(report["cells"])
    if args.rounds > 1 or args.interleave > 1:
        for r in report["pooled"]:
            if "throughput_ratio_vs_plain" in r:
                print(f"[bench] pooled {r['method']}_k{r['k']} T={r['temperature']:g} b={r['batch_size']:>2}: "
                      f"ratio {r['throughput_ratio_vs_plain']:.3f} (rounds {r['round_ratio_min']:.2f}-"
                      f"{r['round_ratio_max']:.2f})", flush=True)
    png = args.out.with_suffix(".png")
    if any(c["method"] != "plain" for c in report["pooled"]):
        plot(report, png)
        report["plot"] = str(png)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"[bench] wrote {args.out}" + (f" and {png}" if "plot" in report else ""))


if __name__ == "__main__":
    main()
