"""A real (small) GRPO loop with speculative rollouts, and the same loop without, same seeds.

Policy: SmolLM2-135M-Instruct (the real fixture). Task (vllm_specrl.rl.tasks): "What is a + b?" with
one-digit numbers; by default ``explain`` (reasoning-style answers of varied length that
stop at EOS, so each step ends with a small-batch tail; reward 1 when the last number is
the sum), or ``arithmetic`` (short answers). Each step: G samples per prompt from ``vllm serve`` over
the OpenAI completions API with logprobs and token ids; the trainer
recomputes the sampled tokens' logprobs with the torch policy (and compares
them with vLLM's: lossless in the RL sense), takes one GRPO policy-gradient
step, and pushes the new weights into the engine in place
(``EngineClient.update_policy``). In the speculative run an EAGLE-3 draft
serves the rollouts, capture streams the policy's hidden states, and the
online draft trainer (``vllm-specrl train-draft --capture``) keeps the draft
following the policy, and k is chosen per engine step (``vllm_specrl.adaptive``;
``--no-adaptive-k`` for a fixed k; ``--no-online-draft`` serves the starting draft frozen, without
capture or trainer, which shows what online adaptation costs here). A ``history`` run serves the rollouts with the
rollout-history proposer instead (drafts from the group's siblings and earlier
rollouts of the same prompt; no draft model, no trainer); ``--proposer history``
runs it beside plain, ``--runs spec,history,plain`` beside EAGLE-3 too, and
``--dataset-size N`` makes prompts come back every N / prompts steps, as epochs do. An ``mtp``
run (``--proposer mtp``) drafts with the policy's own MTP layer (``"method": "mtp"``) on a
policy that has one (default: the real-mimo fixture, SmolLM2's body with a MiMo MTP layer;
every run of the invocation then serves that checkpoint, plain included): the policy update
carries the body alone (``keep_mtp``) and ``train-draft --mtp`` keeps the layer aligned from
the captured states, reading the policy's embedding and final norm from a small directory
this loop rewrites before each update. Each run runs in a fresh copy of this script
(``--no-isolate-runs``: all in this process), so none reuses a heap that a run before it grew,
and the runs take their steps in turn (``--interleave-runs``, when every run is synchronous:
each step of spec, then of plain, the first rotating), so the machine's drift over minutes
falls on both alike.
Before step 0, each engine's adaptive k is calibrated
(``vllm_specrl.adaptive.calibrate``; the same requests warm a plain engine up), the
trainer side runs one throwaway step, and each run takes ``--warm-up-steps`` real RL steps
(default 1) that are recorded apart, so no run pays a start-up cost in its timed steps.
Per step it records generation (split into
bulk and tail: until half of the prompts' requests finished, and the rest),
logprob recomputation, training and sync times, acceptance length, the mean k
chosen, versions and mean reward; at the end it prints a table and writes JSON
and a PNG.

    python scripts/rl_demo.py --fixtures .fixtures            # both runs, defaults
    python scripts/rl_demo.py --runs spec,plain,spec-async --task arithmetic --max-tokens 16
    python scripts/rl_demo.py --runs spec,history,plain --dataset-size 8   # EAGLE-3 and history
    python scripts/rl_demo.py --proposer mtp                            # the policy's own MTP layer
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from vllm_specrl import cpu_malloc, metrics
from vllm_specrl.adaptive.calibrate import WARM_UP_TOKENS
from vllm_specrl.rl.draft_trainer import DraftTrainerProcess, DraftTrainerSettings, pause_file, trainer_cpus
from vllm_specrl.rl.policy import Policy
from vllm_specrl.rl.serving import serve_args
from vllm_specrl.rl.rollouts import check_rollouts, generate_at_lengths, sample_groups
from vllm_specrl.rl.tasks import TASKS, make_tasks, reward
from vllm_specrl.trainer.core import resolve_mixed_precision

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the demo's report, beside it
sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))  # the benchmarks' engine processes
from bench_engine import ParentTurns, host_info  # noqa: E402
from demo_report import PROPOSERS, plot, print_table, summarize  # noqa: E402


def run(mode: str, args: argparse.Namespace, target: Path, work: Path, replay: dict | None = None,
        turns: ParentTurns | None = None) -> dict:
    """One RL run of ``mode``; ``replay`` (runs before it, by mode): after its steps, this engine
    generates their timed steps' rollouts again at exactly their lengths, and its own
    (``replay_lengths``). With ``turns`` (``--interleave-runs``), each step waits for the parent's
    ``{"step": i}`` and reports back; after the last, ``{"finish": {"replay_of": [...]}}`` names the
    runs (their reports in ``work``) whose lengths to replay."""
    from vllm_specrl.proposer.checkpoint import init_draft
    from vllm_specrl.server import VLLMServer, free_port
    from vllm_specrl.sync.client import EngineClient

    policy_dir = work / f"policy_{mode}"
    shutil.rmtree(policy_dir, ignore_errors=True)
    shutil.rmtree(work / f"draft-online-{mode}", ignore_errors=True)
    shutil.rmtree(work / f"policy_head_{mode}", ignore_errors=True)
    pause_file(work, mode).unlink(missing_ok=True)
    shutil.copytree(target, policy_dir)
    speculative = mode.startswith("spec")
    history = mode.startswith("history")
    mtp = mode.startswith("mtp")
    policy_head = work / f"policy_head_{mode}"  # what train-draft --mtp reads of the policy
    asynchronous = mode.endswith("-async")
    proposer = "eagle3" if speculative else "history" if history else "mtp" if mtp else "plain"
    draft = Path(args.draft) if args.draft else work / "draft"
    if speculative and not args.draft:
        init_draft(target, draft, args.draft_vocab_size, seed=args.seed)
    online = args.online_draft and proposer in ("eagle3", "mtp")
    serving = serve_args(proposer, k=args.k, draft=draft if speculative else None, adaptive_k=args.adaptive_k,
                         capture=f"tcp://127.0.0.1:{free_port()}" if online else None, dtype=args.dtype,
                         max_model_len=1024, seed=args.seed)
    trainer = None
    policy = Policy(policy_dir, args.lr, args.seed)
    if mtp and online:
        policy.write_head(policy_dir, policy_head)
    steps, warm_up = [], []
    with VLLMServer(policy_dir, serving.args, log_path=work / f"serve_{mode}.log", enforce_eager=not args.compile,
                    startup_timeout_s=900 if args.compile else 300) as srv:
        client = EngineClient(srv.url, progress=False)
        calibration = None
        if args.calibrate:
            # Before the trainer starts (its capture must not see the sweep) and before step 0; on a
            # plain engine the same requests are its warm-up, so both runs start alike.
            # The history proposer drafts per-request lengths (no steady steps to measure): a warm-up.
            calibration = client.calibrate_adaptive_k(max_batch=args.prompts * args.group,
                                                      steps=WARM_UP_TOKENS if history else 256)
            print(f"[rl:{mode}] calibration {calibration['seconds']:.1f}s: "
                  + ", ".join(f"{b['batch']} seqs -> k {b['best_k']}" for b in calibration["batches"]), flush=True)
        if online:
            # EAGLE-3: the draft reads the policy's head from the served checkpoint (capture_topk sends
            # the targets). MTP: the policy's own layer, trained against the policy's next-token
            # distribution, with embedding and final norm re-read from ``policy_head`` per version.
            trainer = DraftTrainerProcess.start(
                serving.capture, srv.url, policy_dir if mtp else draft, policy_head if mtp else policy_dir, work,
                draft_trainer_settings(args), mtp=mtp, cpus=trainer_cpus(args.draft_trainer_cpus, client.status()),
                name=mode)
        pool = ThreadPoolExecutor(1)

        def rollouts(step: int):
            tasks = make_tasks(step, args.prompts, args.seed, args.task, args.dataset_size)
            return sample_groups(srv.url, srv.model, [policy.chat(p) for p, _ in tasks], args.group,
                                 args.max_tokens, step_seed(args, step), step,
                                 lambda i, text: reward(text, tasks[i][1], args.task))

        try:
            # Async (policy lag 1): rollouts of step t+1 run while step t trains; the update lands in
            # flight (pause "keep": running requests continue on the new weights, KV recomputed), so a
            # rollout can span two versions, which its headers record and the clipped ratio corrects.
            pending = pool.submit(rollouts, 0) if asynchronous else None
            # Acceptance per step from the engine's counters between consecutive snapshots taken
            # after each step's rollouts arrive (in async mode they ran during the previous step).
            before = client.status()
            total = args.warm_up_steps + args.steps
            # Step i samples task set i and leaves policy version i + 1; the first warm_up_steps are
            # recorded apart (steps -N..-1) and left out of the summary.
            for i in range(total):
                step = i - args.warm_up_steps
                if turns is not None and next_turn(turns, mode, "step") != i:
                    raise RuntimeError(f"[rl:{mode}] the parent's step index is not {i}")
                # The draft trainer trains while rollouts run; paused (when it yields) from the policy
                # phases until the next step's rollouts, and so also while another run takes its turn.
                if trainer is not None:
                    trainer.resume()
                started_at = time.time()
                t_step = time.perf_counter()
                t0 = time.perf_counter()
                if asynchronous:
                    samples, timing = pending.result()
                    pending = pool.submit(rollouts, i + 1) if i + 1 < total else None
                else:
                    samples, timing = rollouts(i)
                t_gen = timing["generation_s"]
                t_exposed = time.perf_counter() - t0
                after = client.status()
                check_rollouts(samples, i, args.prompts, args.group)
                if trainer is not None and args.draft_trainer_yields and not asynchronous:
                    trainer.pause()  # the policy phases get the cores; resumed before the next rollouts
                # Logprob recomputation and the update in one pass, micro-batch by micro-batch (one
                # micro-batch's autograd graph alive at a time); its forward and update times apart.
                f0 = page_faults()
                logps, loss, t_logp, t_train = policy.grpo_pass(samples, args.group, args.clip)
                f_policy = page_faults() - f0
                abs_diffs = [(lp - torch.tensor(s["vllm_logprobs"])).abs() for lp, s in zip(logps, samples)]
                diffs = torch.cat(abs_diffs)
                on_policy = [s["policy_version_start"] == s["policy_version_end"] == policy.version for s in samples]
                t0 = time.perf_counter()
                if mtp and online:
                    policy.write_head(policy_dir, policy_head)  # before the commit the trainer sees
                # An MTP run sends the body alone: the served MTP layer is the online trainer's (or,
                # with --no-online-draft, the checkpoint's, frozen).
                client.update_policy(policy.model.named_parameters(), version=i + 1,
                                     pause="keep" if asynchronous else "wait", keep_mtp=mtp)
                policy.version = i + 1
                # Nothing to write for the draft trainer: capture_topk sends it the policy's own
                # next-token distributions with every captured row.
                t_sync = time.perf_counter() - t0
                served = metrics.summary_delta(before["spec_decode"], after["spec_decode"])
                versions = sorted({(s["policy_version_start"], s["policy_version_end"]) for s in samples})
                rec = {"step": step, "mean_reward": sum(s["reward"] for s in samples) / len(samples),
                       "rewards": [s["reward"] for s in samples], "loss": loss,
                       "generation_s": t_gen, "generation_bulk_s": timing["bulk_s"],
                       "generation_tail_s": timing["tail_s"],
                       "completion_tokens": sorted(len(s["completion_ids"]) for s in samples),
                       "completion_lengths": completion_lengths(samples, args.prompts, args.group),
                       "mean_k": mean_k(before.get("adaptive_k"), after.get("adaptive_k")),
                       # per batch-size bucket: the k served, step costs, live per-position acceptance
                       "adaptive_k_state": after.get("adaptive_k"),
                       "exposed_generation_s": t_exposed, "logprob_s": t_logp,
                       "training_s": t_train, "sync_s": t_sync, "step_s": time.perf_counter() - t_step,
                       "started_at": started_at, "ended_at": time.time(),  # wall clock: runs' turns
                       # this process's page faults in the policy phases (vllm_specrl.cpu_malloc)
                       "policy_page_faults": f_policy,
                       "rollouts": len(samples), "tokens": sum(len(s["completion_ids"]) for s in samples),
                       "acceptance_length": served["acceptance_length"],
                       # the first draft token's acceptance: unlike the length, independent of the k's served
                       "accept_pos0": (served["per_position_acceptance"] or [0.0])[0]
                       if served["num_drafts"] else None,
                       "policy_version": after["versions"]["policy"], "draft_version": after["versions"]["draft"],
                       "rollout_policy_versions": [list(v) for v in versions],
                       "rollouts_from_trained_version": sum(on_policy),
                       "logprob_abs_diff_max": float(diffs.max()), "logprob_abs_diff_mean": float(diffs.mean())}
                # Same sequences, recomputed by the trainer: only on-policy rollouts can match vLLM exactly.
                same = [d for d, on in zip(abs_diffs, on_policy) if on]
                rec["on_policy_logprob_abs_diff_max"] = float(torch.cat(same).max()) if same else None
                (steps if step >= 0 else warm_up).append(rec)
                before = after
                print(f"[rl:{mode}] {'warm-up ' if step < 0 else ''}step {step}: reward {rec['mean_reward']:.2f}, gen {t_gen:.1f}s "
                      f"(bulk {timing['bulk_s']:.1f}s, tail {timing['tail_s']:.1f}s"
                      + (f", mean k {rec['mean_k']:.2f}" if rec["mean_k"] is not None else "") + ") "
                      f"(exposed {t_exposed:.1f}s), logp {t_logp:.1f}s, train {t_train:.1f}s, sync {t_sync:.1f}s, "
                      f"step {rec['step_s']:.1f}s, accept {rec['acceptance_length'] or float('nan'):.2f} "
                      f"(first draft {rec['accept_pos0'] if rec['accept_pos0'] is not None else float('nan'):.3f}), "
                      f"versions {versions}, "
                      f"|dlogp| max {rec['logprob_abs_diff_max']:.3f}", flush=True)
                if turns is not None:
                    turns.report({"step": step, "step_s": rec["step_s"]})
            if turns is not None:
                replay = {m: read_run(work, m) for m in next_turn(turns, mode, "finish")["replay_of"]}
            if replay:
                length_replays = replay_lengths(srv, policy, args, {**replay, mode: {"steps": steps}}, mode)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # a queued next-step rollout is dropped
            if trainer is not None and not trainer.stop():  # a stuck trainer must not fail the RL run
                print(f"[rl:{mode}] draft trainer did not exit in 120 s after SIGINT: killed", flush=True)
    return {"mode": mode, "steps": steps, "warm_up_steps": warm_up, "calibration": calibration,
            "draft_publish_gate": publish_gate_verdicts(work / f"online_draft_{mode}.jsonl"),
            **({"length_replays": length_replays} if replay else {})}


def next_turn(turns: ParentTurns, mode: str, expected: str) -> Any:
    """The parent's next command, which must be ``expected`` ("step" or "finish"); a quit (the parent
    stopping every run, say because another failed) ends this run cleanly (its trainer and engine
    shut down on the way out)."""
    command = turns.next()
    if command.get("quit"):
        raise SystemExit(f"[rl:{mode}] stopped by the parent before its next {expected}")
    if expected not in command:
        raise RuntimeError(f"[rl:{mode}] expected a {expected} command from the parent, got {command}")
    return command[expected]


def step_seed(args: argparse.Namespace, step: int) -> int:
    """The seed of step ``step``'s first request (``sample_groups`` seeds every sample apart)."""
    return (args.seed * 7919 + step) * args.prompts * args.group


def completion_lengths(samples: list[dict], prompts: int, group: int) -> list[list[int]]:
    """Tokens generated by sample j of prompt i, as ``[i][j]``: what ``replay_lengths`` generates again."""
    out = [[0] * group for _ in range(prompts)]
    for s in samples:
        out[s["group"]][int(s["rollout_id"].rsplit("/", 1)[1])] = len(s["completion_ids"])
    return out


def replay_lengths(srv, policy: Policy, args: argparse.Namespace, runs: dict, mode: str) -> dict:
    """Each timed step's rollouts of every run in ``runs`` generated again on this engine, at exactly the
    lengths that run sampled (``rl.rollouts.generate_at_lengths``), the runs in turn within a step.

    Two runs sample different answers from the same distribution, and with 4 steps of 16 answers
    their lengths differ by up to 20% by chance, which moves the rollout-time ratio as much as
    speculation does. Timing the plain engine on the speculative run's own lengths compares the
    engines on identical work; replaying this run's own lengths too checks the replay against the
    times its loop measured."""
    out: dict = {m: [] for m in runs}
    for rec in runs[mode]["steps"]:
        i = rec["step"] + args.warm_up_steps
        prompts = [policy.chat(p) for p, _ in make_tasks(i, args.prompts, args.seed, args.task, args.dataset_size)]
        for m, r in runs.items():
            ref = next(s for s in r["steps"] if s["step"] == rec["step"])
            seconds, produced = generate_at_lengths(srv.url, srv.model, prompts, ref["completion_lengths"],
                                                    step_seed(args, i))
            out[m].append({"step": rec["step"], "generation_s": seconds, "completion_lengths": produced})
        print(f"[rl:{mode}] step {rec['step']} at the lengths of "
              + ", ".join(f"{m}: {out[m][-1]['generation_s']:.1f}s" for m in runs), flush=True)
    return out


def publish_gate_verdicts(log: Path) -> list[dict]:
    """The online trainer's publish decisions (held-out estimates of the candidate and the served draft),
    and after each hold the policy versions its rest spans (``--rest-backoff-max``)."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record.get("gate"):
            out.append({"time": record["time"], "trainer_step": record["step"],
                        "policy_version": record["policy_version"], **record["gate"],
                        **({"rest_span_versions": record["rest_span_versions"]} if record.get("rest") else {})})
    return out


def warm_up_trainer(target: Path, args: argparse.Namespace) -> float:
    """One throwaway logprob pass and GRPO step on the largest batch a step can have, before any run.

    The first run of an invocation otherwise pays torch's one-time start-up costs in its first
    steps' logprob and training phases (measured: 19 s vs 7-10 s for step 0's logprobs, either
    order, with or without the draft trainer), which biased the step-time ratio ~5% against
    whichever run went first. Every completion is at the cap so that this process's heap reaches
    the largest size a step needs (``cpu_malloc.keep_every_block_on_heap`` keeps it): with a
    step-shaped batch instead, the first run's longest step still grew the heap by 2 GB (519
    thousand page faults in its log-prob pass, none in the second run)."""
    t0 = time.perf_counter()
    policy = Policy(target, args.lr, args.seed)
    prompt = policy.tok(policy.chat(make_tasks(0, 1, args.seed, args.task)[0][0]))["input_ids"]
    n = args.prompts * args.group
    completion = (prompt * (args.max_tokens // len(prompt) + 1))[:args.max_tokens]  # every sample at the cap
    samples = [{"prompt_ids": prompt, "completion_ids": completion, "vllm_logprobs": [0.0] * len(completion),
                "reward": float(i % 2)} for i in range(n)]
    policy.grpo_pass(samples, args.group, args.clip)
    del policy
    seconds = time.perf_counter() - t0
    print(f"[rl] trainer warm-up {seconds:.1f}s (a throwaway step on {n} synthetic samples)", flush=True)
    return seconds


def read_run(work: Path, mode: str) -> dict:
    """The report of run ``mode`` that its own process wrote in ``work``."""
    return json.loads((work / f"run_{mode}.json").read_text())["runs"][mode]


def own_process_args(mode: str, target: Path, work: Path) -> list[str]:
    """This invocation's arguments for a process of its own that runs ``mode`` alone."""
    # The same arguments with this run alone (later options win in argparse); --proposer would
    # override --runs, and the target it chose is passed as such (an mtp invocation serves real-mimo
    # in every run, plain included).
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip or a.startswith("--proposer="):
            skip = False
            continue
        skip = a == "--proposer"
        if not skip:
            argv.append(a)
    return [*argv, "--runs", mode, "--target", str(target), "--no-isolate-runs", "--work-dir", str(work),
            "--out", str(work / f"run_{mode}.json")]


def run_in_own_process(mode: str, target: Path, work: Path, replay: list[str]) -> dict:
    """One run in a fresh copy of this script (same arguments, ``--runs mode``), its report's run read back.

    In one process the first run grows the heap that the ones after it reuse: with every run in
    the same process, spec's log-prob passes (first) still faulted 109-175 thousand fresh pages a
    step (0.7-1.5 s) where plain's (second) faulted none, after the trainer warm-up. Each run now
    starts as the first does: its own process, its own trainer warm-up, its own heap. ``replay``:
    the runs before it (their reports in ``work``) whose lengths it generates again."""
    subprocess.run([sys.executable, os.path.abspath(__file__), *own_process_args(mode, target, work),
                    *(["--replay-lengths-of", ",".join(replay)] if replay else [])], check=True)
    return read_run(work, mode)


def run_interleaved(modes: list[str], args: argparse.Namespace, target: Path, work: Path,
                    to_replay: Callable[[str], list[str]], finished: Callable[[str, dict], None]) -> None:
    """``--interleave-runs``: every run in its own process, started one after another (each
    one's engine start, calibration and trainer start alone on the cores), then step by step in
    turn, the first run rotating each step; then each finishes (proposer runs first, so a plain
    run can replay their lengths) and ``finished(mode, run)`` gets its report.

    Why: run one after another, two runs' engines read several percent apart on this shared VM
    (the same engine's step time drifts 10-15% within a minute), more than speculation's margin
    at 16 sequences; a step of each in turn sees the same drift. While one run steps, the
    others wait on their stdin, their engines idle and their draft trainers paused."""
    from contextlib import ExitStack

    from bench_engine import EngineProcess

    with ExitStack() as stack:
        procs = {}
        for mode in modes:
            print(f"[rl] starting the {mode} run (trainer warm-up, engine, calibration); "
                  "it then waits for its turns", flush=True)
            procs[mode] = stack.enter_context(EngineProcess(
                os.path.abspath(__file__), None, dict(os.environ), None, RUN_TURN_TIMEOUT_S,
                args=[*own_process_args(mode, target, work), "--_take-turns"]))
        rounds, started = args.warm_up_steps + args.steps, time.time()
        for i in range(rounds):
            for j in range(len(modes)):
                procs[modes[(i + j) % len(modes)]].request({"step": i})
            per_round = (time.time() - started) / (i + 1)
            print(f"[rl] round {i + 1}/{rounds} (a step of every run) done; about "
                  f"{format_minutes(per_round * (rounds - i - 1))} of steps left", flush=True)
        for mode in sorted(modes, key=lambda m: not m.startswith(PROPOSERS)):
            procs[mode].request({"finish": {"replay_of": to_replay(mode)}})
            finished(mode, read_run(work, mode))


def format_minutes(seconds: float) -> str:
    """``m:ss``, as a progress line shows a duration."""
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


RUN_TURN_TIMEOUT_S = 1800.0  # a run's start-up (engine, calibration, trainer), one step, or its finish


def page_faults() -> int:
    """Minor page faults of this process so far: the policy phases' cost in fresh pages."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def mean_k(before: dict | None, after: dict | None) -> float | None:
    """Mean k the adaptive controller chose over the steps between two status snapshots."""
    if not after:
        return None
    b = before["chosen_k_counts"] if before else [0] * len(after["chosen_k_counts"])
    counts = [x - y for x, y in zip(after["chosen_k_counts"], b)]
    return sum(k * n for k, n in enumerate(counts)) / sum(counts) if sum(counts) else None


def draft_trainer_settings(args: argparse.Namespace) -> DraftTrainerSettings:
    return DraftTrainerSettings(publish_every=args.draft_publish_every, lr=args.draft_lr, tv_weight=args.draft_tv_weight,
                                replay_ratio=args.draft_replay_ratio, holdout_every=args.draft_holdout_every,
                                mixed_precision=args.draft_mixed_precision, niceness=args.draft_nice,
                                sched_idle=args.draft_sched_idle, yields=args.draft_trainer_yields)


def build_parser() -> argparse.ArgumentParser:
    """The demo's options (``scripts/bench/bench_online_cost.py`` reads the draft trainer's defaults here)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--target", type=Path, default=None, help="policy checkpoint (default: the real fixture)")
    ap.add_argument("--runs", default="spec,plain",
                    help="comma list of spec (EAGLE-3), history (rollout-history proposer), mtp (the policy's own "
                         "MTP layer; needs a target that has one), plain, and their -async forms (policy lag 1)")
    ap.add_argument("--proposer", choices=["eagle3", "history", "mtp"], default=None,
                    help="shorthand: --proposer history runs history,plain; eagle3 runs spec,plain; mtp runs mtp,plain "
                         "on the real-mimo fixture")
    ap.add_argument("--dataset-size", type=int, default=None,
                    help="draw prompts from a fixed set of this many tasks, in epochs (default: new ones each step)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warm-up-steps", type=int, default=1,
                    help="RL steps each run takes before its timed ones (a long RL job's steady state): the "
                         "first step paid 1.3-1.6x the later ones' generation and log-prob time in whichever "
                         "run went first; recorded under warm_up_steps, left out of the summary")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--task", default="explain", choices=TASKS,
                    help="arithmetic: short answers; explain: reasoning-style answers of varied length")
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="explain answers run 8-256 tokens (mean ~100; 12% reach 256): each step ends in a tail")
    ap.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=True,
                    help="EAGLE-3 and MTP runs choose k per step (vllm_specrl.adaptive); --no-adaptive-k: fixed k "
                         "(a history run drafts per request by its own cost fit either way)")
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                    help="before step 0, measure every k's step cost at each batch size (vllm-specrl calibrate; "
                         "adaptive k), as an RL job would once at start-up; plain runs get the same requests as a "
                         "warm-up; --no-calibrate: adaptive k measures on the live rollouts")
    ap.add_argument("--warm-up-trainer", action=argparse.BooleanOptionalAction, default=True,
                    help="one throwaway logprob pass and GRPO step before the first run, so the first run does "
                         "not pay torch's start-up costs in its timed steps")
    ap.add_argument("--isolate-runs", action=argparse.BooleanOptionalAction, default=True,
                    help="each run in its own process (a fresh copy of this script with its own trainer warm-up), "
                         "so no run reuses the heap a run before it grew; --no-isolate-runs: all runs in this "
                         "process, one trainer warm-up before the first")
    ap.add_argument("--replay-lengths", action=argparse.BooleanOptionalAction, default=True,
                    help="after its steps, a plain run generates each timed step's rollouts of the speculative runs "
                         "before it again, at exactly their answers' lengths (ignore_eos), and its own: spec's "
                         "rollout time against plain's engine on identical work, without the chance in how long "
                         "two runs' answers ran (about 30 s per step at the defaults)")
    ap.add_argument("--interleave-runs", action=argparse.BooleanOptionalAction, default=True,
                    help="with --isolate-runs and every run synchronous: keep the runs' processes alive together "
                         "and take their steps in turn, the first run rotating each step, so that the machine's "
                         "drift over minutes falls on every run alike (--no-interleave-runs: one run after another)")
    ap.add_argument("--_take-turns", dest="take_turns", action="store_true",
                    help=argparse.SUPPRESS)  # set by --interleave-runs: steps on the parent's command
    ap.add_argument("--replay-lengths-of", default="", help=argparse.SUPPRESS)  # set by --isolate-runs
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where the runs keep policies, drafts and logs (default: <out stem>_work beside --out)")
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--clip", type=float, default=0.2, help="PPO clip of the importance ratio")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft to start from (default: fresh)")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--draft-replay-ratio", type=float, default=4.0,
                    help="online draft trainer: samples trained per captured rollout")
    ap.add_argument("--online-draft", action=argparse.BooleanOptionalAction, default=True,
                    help="capture the policy's states and train the draft online; --no-online-draft serves the "
                         "starting draft frozen (no capture, no trainer)")
    ap.add_argument("--draft-lr", type=float, default=2e-4,
                    help="online draft trainer's learning rate (fine-tuning the warm-started draft: at 1e-3 it "
                         "lost held-out acceptance, at 2e-4 it gained; benchmarks/README.md)")
    ap.add_argument("--draft-tv-weight", type=float, default=0.0,
                    help="online draft trainer: add this times TV(p, q), 1 - the acceptance at T=1, to its "
                         "cross-entropy (fine-tuning the demo draft: +0.9%% held-out acceptance at 4)")
    ap.add_argument("--draft-publish-every", type=int, default=4,
                    help="online draft trainer: publish the draft to the engine every N training steps")
    ap.add_argument("--draft-holdout-every", type=int, default=4,
                    help="online draft trainer: hold every n-th rollout out of training and publish only drafts "
                         "whose estimated acceptance on them beats the served draft's (0: publish on schedule)")
    ap.add_argument("--draft-mixed-precision", choices=["no", "bf16", "auto"], default="auto",
                    help="online draft trainer's precision (auto: bf16 autocast where the CPU multiplies bf16 "
                         "natively, half the cycles it takes from the engine and this loop)")
    ap.add_argument("--draft-trainer-yields", action=argparse.BooleanOptionalAction, default=True,
                    help="pause the online draft trainer's training (not its capture) during the policy's logprob, "
                         "update and sync phases: on a shared CPU it took 5-10%% of the cores the policy used "
                         "even at nice 19 (on a GPU cluster it has its own device)")
    ap.add_argument("--draft-trainer-cpus", choices=["auto", "any"], default="auto",
                    help="where the online draft trainer runs: auto, the CPUs vLLM's CPU worker leaves to its engine "
                         "core (where the capture sender runs), so it never takes the forward's core; any: anywhere")
    ap.add_argument("--draft-nice", type=int, default=19,
                    help="niceness of the online draft trainer process: it shares this machine's cores with the "
                         "engine and the policy update, so by default it only takes the cycles they leave")
    ap.add_argument("--draft-sched-idle", action=argparse.BooleanOptionalAction, default=True,
                    help="run the online draft trainer under SCHED_IDLE as well: it takes only cycles the engine "
                         "and this loop leave")
    ap.add_argument("--dtype", default=None,
                    help="serving dtype of both engines (default: bfloat16 where this CPU multiplies bf16 "
                         "natively, AVX512-BF16 or AMX, where a plain step ran 1.45x faster than float32; "
                         "float32 elsewhere: an AVX2 CPU emulates bf16 matmuls, ~10x slower)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                    help="serve every run with vLLM's torch.compile (its default; about a minute more per engine "
                         "start) instead of eager mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/rl_demo.json"))
    return ap


def main() -> None:
    args = build_parser().parse_args()
    cpu_malloc.keep_every_block_on_heap()  # the policy's log-prob pass and update (vllm_specrl.cpu_malloc)
    args.dtype = args.dtype or ("bfloat16" if resolve_mixed_precision("auto") == "bf16" else "float32")
    if args.proposer:
        args.runs = {"history": "history,plain", "mtp": "mtp,plain"}.get(args.proposer, "spec,plain")

    from vllm_specrl.fixtures import fixture_target

    wants_mtp = any(m.startswith("mtp") for m in args.runs.split(","))
    target = args.target or Path(fixture_target("real-mimo" if wants_mtp else "real", args.fixtures))
    work = args.work_dir or args.out.parent / (args.out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)
    report = {"demo": "grpo_speculative_rollouts", "host": host_info(), "settings": {k: str(v) for k, v in vars(args).items()},
              "pid": os.getpid(), "runs": {}}
    modes = args.runs.split(",")

    def to_replay(mode: str) -> list[str]:
        """A plain run replays the lengths of the proposer runs before it."""
        if not (args.replay_lengths and mode.startswith("plain")):
            return []
        return [m for m in report["runs"] if m.startswith(PROPOSERS)]

    interleave = args.isolate_runs and len(modes) > 1 and args.interleave_runs and not any(
        m.endswith("-async") for m in modes)
    report["interleaved_runs"] = interleave
    if interleave:
        def finished(mode: str, run_: dict) -> None:
            report["runs"][mode] = run_
            args.out.write_text(json.dumps(report, indent=2))

        run_interleaved(modes, args, target, work, to_replay, finished)
        report["runs"] = {m: report["runs"][m] for m in modes}  # in --runs order, as run one after another
    elif args.isolate_runs and len(modes) > 1:
        if args.interleave_runs:
            print("[rl] an async run takes its next rollouts while it trains: the runs go one after another",
                  flush=True)
        for mode in modes:
            report["runs"][mode] = run_in_own_process(mode, target, work, to_replay(mode))
            args.out.write_text(json.dumps(report, indent=2))
    else:
        warm_up_s = warm_up_trainer(target, args) if args.warm_up_trainer else None
        # a run of an isolated invocation: the runs before it are in the work dir
        earlier = {m: read_run(work, m) for m in args.replay_lengths_of.split(",") if m}
        turns = ParentTurns() if args.take_turns else None
        for mode in modes:
            replay = {**earlier, **{m: report["runs"][m] for m in to_replay(mode)}}
            report["runs"][mode] = {**run(mode, args, target, work, replay, turns), "pid": os.getpid(),
                                    "trainer_warm_up_s": warm_up_s}
            args.out.write_text(json.dumps(report, indent=2))
    report["summary"] = summarize(report["runs"])
    png = args.out.with_suffix(".png")
    plot(report, png)
    report["plot"] = str(png)
    args.out.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"wrote {args.out} and {png}")
    if args.take_turns:
        ParentTurns().report({"out": str(args.out)})  # the parent reads the report once it is written


if __name__ == "__main__":
    main()
