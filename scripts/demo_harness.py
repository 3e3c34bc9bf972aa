"""The RL demo's benchmark harness around the loop (``scripts/rl_demo.py``): each run in its own process,
the runs taking their steps in turn, the plain run replaying the proposer runs' answer lengths, a
throwaway trainer step before the first, and the per-step record the report reads.

Why each exists: runs one after another in one process reuse the heap the first grew and see the
machine's drift over minutes apart; two runs sample answers of different lengths by chance. Each
run in a fresh process, steps in turn, and timing the plain engine on the speculative run's own
lengths take those out of the ratios (benchmarks/README.md has the figures).
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
from pathlib import Path
from typing import Any

from vllm_specrl.rl.draft_trainer import DraftTrainerProcess, DraftTrainerSettings
from vllm_specrl.rl.loop import StepResult, rollout_seed
from vllm_specrl.rl.policy import Policy
from vllm_specrl.rl.rollouts import generate_at_lengths
from vllm_specrl.rl.tasks import make_tasks

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))  # the benchmarks' engine processes
from bench_engine import EngineProcess, ParentTurns, engines_alive, in_turns  # noqa: E402
from demo_report import PROPOSERS  # noqa: E402

RUN_TURN_TIMEOUT_S = 1800.0  # a run's start-up (engine, calibration, trainer), one step, or its finish


def step_record(result: StepResult, args: argparse.Namespace, page_faults: int, started_at: float) -> dict:
    """What the report keeps of one step (``demo_report.summarize`` reads it)."""
    samples, served = result.samples, result.served
    diffs = result.logprob_abs_diff()
    same = result.on_policy_logprob_abs_diff()
    return {"step": result.step - args.warm_up_steps,
            "mean_reward": sum(s["reward"] for s in samples) / len(samples),
            "rewards": [s["reward"] for s in samples], "loss": result.loss,
            "generation_s": result.generation["generation_s"], "generation_bulk_s": result.generation["bulk_s"],
            "generation_tail_s": result.generation["tail_s"],
            "completion_tokens": sorted(len(s["completion_ids"]) for s in samples),
            "completion_lengths": completion_lengths(samples, args.prompts, args.group),
            "mean_k": mean_k(result.status_before.get("adaptive_k"), result.status.get("adaptive_k")),
            # per batch-size bucket: the k served, step costs, live per-position acceptance
            "adaptive_k_state": result.status.get("adaptive_k"),
            "exposed_generation_s": result.exposed_generation_s, "logprob_s": result.logprob_s,
            "training_s": result.training_s, "sync_s": result.sync_s, "step_s": result.step_s,
            "started_at": started_at, "ended_at": time.time(),  # wall clock: the runs' turns
            "page_faults": page_faults,  # this process's over the step: the policy phases' fresh pages
            "rollouts": len(samples), "tokens": sum(len(s["completion_ids"]) for s in samples),
            "acceptance_length": served["acceptance_length"],
            # the first draft token's acceptance: unlike the length, independent of the k's served
            "accept_pos0": (served["per_position_acceptance"] or [0.0])[0] if served["num_drafts"] else None,
            "policy_version": result.status["versions"]["policy"], "draft_version": result.status["versions"]["draft"],
            "rollout_policy_versions": [list(v) for v in sorted(
                {(s["policy_version_start"], s["policy_version_end"]) for s in samples})],
            "rollouts_from_trained_version": sum(result.on_policy),
            "logprob_abs_diff_max": float(max(d.max() for d in diffs)),
            "logprob_abs_diff_mean": float(sum(d.sum() for d in diffs) / max(1, sum(d.numel() for d in diffs))),
            "on_policy_logprob_abs_diff_max": float(max(d.max() for d in same)) if same else None}


def page_faults() -> int:
    """Minor page faults of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def mean_k(before: dict | None, after: dict | None) -> float | None:
    """Mean k the adaptive controller chose over the steps between two status snapshots."""
    if not after:
        return None
    b = before["chosen_k_counts"] if before else [0] * len(after["chosen_k_counts"])
    counts = [x - y for x, y in zip(after["chosen_k_counts"], b)]
    return sum(k * n for k, n in enumerate(counts)) / sum(counts) if sum(counts) else None


def draft_trainer_settings(args: argparse.Namespace) -> DraftTrainerSettings:
    return DraftTrainerSettings(publish_every=args.draft_publish_every, lr=args.draft_lr,
                                tv_weight=args.draft_tv_weight,
                                replay_ratio=args.draft_replay_ratio, holdout_every=args.draft_holdout_every,
                                mixed_precision=args.draft_mixed_precision, niceness=args.draft_nice,
                                sched_idle=args.draft_sched_idle, yields=args.draft_trainer_yields)


def policy_paths(work: Path, mode: str) -> tuple[Path, Path]:
    """A run's own copy of the policy checkpoint and the policy head it writes for an MTP drafter."""
    return work / f"policy_{mode}", work / f"policy_head_{mode}"


def clear_stale_run(work: Path, mode: str) -> None:
    """Remove what an earlier run of ``mode`` left in ``work`` that a new run must not inherit: its policy copy
    and policy head, its online trainer's checkpoint (a trainer resumes from one) and its trainer's log (the
    trainer appends to it, and the report reads every publish-gate verdict in it as this run's)."""
    trainer = DraftTrainerProcess(None, work, mode)
    for path in (*policy_paths(work, mode), trainer.checkpoint_dir):
        shutil.rmtree(path, ignore_errors=True)
    trainer.log.unlink(missing_ok=True)


# --- answers at the same lengths -----------------------------------------------------------

def completion_lengths(samples: list[dict], prompts: int, group: int) -> list[list[int]]:
    """Tokens generated by sample j of prompt i, as ``[i][j]``: what ``replay_lengths`` generates again."""
    out = [[0] * group for _ in range(prompts)]
    for s in samples:
        out[s["group"]][int(s["rollout_id"].rsplit("/", 1)[1])] = len(s["completion_ids"])
    return out


def replay_lengths(url: str, model: str, policy: Policy, args: argparse.Namespace, runs: dict, mode: str) -> dict:
    """Each timed step's rollouts of every run in ``runs`` generated again on this engine, at exactly the
    lengths that run sampled (``rl.rollouts.generate_at_lengths``), the runs in turn within a step; this
    run's own lengths too, which checks the replay against the times its loop measured."""
    out: dict = {m: [] for m in runs}
    for rec in runs[mode]["steps"]:
        i = rec["step"] + args.warm_up_steps
        prompts = [policy.chat(p) for p, _ in make_tasks(i, args.prompts, args.seed, args.task, args.dataset_size)]
        for m, r in runs.items():
            ref = next(s for s in r["steps"] if s["step"] == rec["step"])
            timing, produced = generate_at_lengths(url, model, prompts, ref["completion_lengths"],
                                                   rollout_seed(args.seed, i, args.prompts * args.group))
            out[m].append({"step": rec["step"], **timing, "completion_lengths": produced})
        print(f"[rl:{mode}] step {rec['step']} at the lengths of "
              + ", ".join(f"{m}: {out[m][-1]['generation_s']:.1f}s" for m in runs), flush=True)
    return out


def warm_up_trainer(target: Path, args: argparse.Namespace) -> float:
    """One throwaway logprob pass and GRPO step before any run, every completion at the cap: torch's
    one-time start-up costs and the heap's growth to the largest step (``cpu_malloc`` keeps it) land
    here instead of in the first run's timed steps."""
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


# --- runs in their own processes, taking turns ---------------------------------------------

def next_turn(turns: ParentTurns, mode: str, expected: str) -> Any:
    """The parent's next command, which must be ``expected`` ("step" or "finish"); a quit (the parent
    stopping every run, say because another failed) ends this run cleanly."""
    command = turns.next()
    if command.get("quit"):
        raise SystemExit(f"[rl:{mode}] stopped by the parent before its next {expected}")
    if expected not in command:
        raise RuntimeError(f"[rl:{mode}] expected a {expected} command from the parent, got {command}")
    return command[expected]


def read_run(work: Path, mode: str) -> dict:
    """The report of run ``mode`` that its own process wrote in ``work``."""
    return json.loads((work / f"run_{mode}.json").read_text())["runs"][mode]


def own_process_args(mode: str, target: Path, work: Path) -> list[str]:
    """This invocation's arguments for a process of its own that runs ``mode`` alone (later options win
    in argparse; --proposer would override --runs, and the target it chose is passed as such)."""
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


def run_in_own_process(script: str, mode: str, target: Path, work: Path, replay: list[str]) -> dict:
    """One run in a fresh copy of ``script`` (same arguments, ``--runs mode``), its report's run read back;
    ``replay``: the runs before it (their reports in ``work``) whose lengths it generates again."""
    subprocess.run([sys.executable, script, *own_process_args(mode, target, work),
                    *(["--replay-lengths-of", ",".join(replay)] if replay else [])], check=True)
    return read_run(work, mode)


def run_interleaved(script: str, modes: list[str], rounds: int, target: Path, work: Path,
                    to_replay: Callable[[str], list[str]], finished: Callable[[str, dict], None]) -> None:
    """Every run in its own process, started one after another (each start alone on the cores), then
    step by step in turn, the first run rotating each step (``bench_engine.in_turns``); then each
    finishes (proposer runs first, so a plain run can replay their lengths) and ``finished(mode, run)``
    gets its report. While one run steps, the others wait on their stdin, their trainers paused."""
    starts = {mode: (lambda mode=mode: EngineProcess(script, None, dict(os.environ), None, RUN_TURN_TIMEOUT_S,
                                                     args=[*own_process_args(mode, target, work), "--_take-turns"]))
              for mode in modes}
    announce = lambda mode: print(f"[rl] starting the {mode} run (trainer warm-up, engine, calibration); "  # noqa: E731
                                  "it then waits for its turns", flush=True)
    with engines_alive(starts, announce) as procs:
        failed = {mode: proc for mode, proc in procs.items() if isinstance(proc, str)}
        if failed:
            raise RuntimeError(f"[rl] runs failed to start: {failed}")
        started, done = time.time(), 0
        for mode, _, result in in_turns(procs, rounds, lambda mode, i: {"step": i}):
            if isinstance(result, str):
                raise RuntimeError(f"[rl] the {mode} run failed: {result}")
            done += 1
            if done % len(modes) == 0:
                per_round = (time.time() - started) / (done // len(modes))
                print(f"[rl] round {done // len(modes)}/{rounds} (a step of every run) done; about "
                      f"{format_minutes(per_round * (rounds - done // len(modes)))} of steps left", flush=True)
        for mode in sorted(modes, key=lambda m: not m.startswith(PROPOSERS)):
            procs[mode].request({"finish": {"replay_of": to_replay(mode)}})
            finished(mode, read_run(work, mode))


def format_minutes(seconds: float) -> str:
    """``m:ss``, as a progress line shows a duration."""
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"
