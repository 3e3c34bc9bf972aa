"""Does the draft go stale, and what does online training buy? A GRPO run in which the policy learns,
served by one arm after another on the same seeds.

Arms (``--arms``): ``plain`` (no speculation), ``frozen`` (EAGLE-3, the starting draft served throughout),
``online`` (EAGLE-3 with capture and the online draft trainer publishing in place), ``online-async`` (the
same with policy lag 1), and ``lossy`` (a planted lossy arm: plain vLLM sampling at temperature 0.8, which
the RL-level lossless test must catch). Speculative arms serve a fixed k (``--k``): acceptance is then
comparable between arms, which adaptive k would not allow.

Task (``--task``, default ``concise``): the RL demo's "What is a + b? Explain ..." prompts, rewarded half for
the right conclusion and half for an answer of at most 25 words, so RL changes what the policy writes
(length and wording) and a draft built on the starting policy's answers can go stale. ``--switch-at N
--switch-task concise-minus`` switches to a second task at step N (a drift the frozen draft never saw).

Each (arm, seed) runs in its own process (``vllm serve``, the policy's trainer, for ``online`` the draft
trainer) and writes ``<out>/runs/<arm>_s<seed>.json`` when it ends: an interrupted benchmark resumes with
the runs it has. At the end ``<out>/rl_run.json`` and ``<out>/rl_run.png`` (``rl_run_report.py``).

    python scripts/rl_run.py --fixtures .fixtures --draft DRAFT --out results/rl_run
    python scripts/rl_run.py ... --arms plain,frozen,online --seeds 0,1,2          # the RL-level test
    python scripts/rl_run.py ... --switch-at 15 --switch-task concise-minus         # a second task at step 15
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the report, beside it
from rl_run_report import ARMS, PROPOSER, build_report, plot, print_summary  # noqa: E402

LOSSY_TEMPERATURE = 0.8  # the planted lossy arm's sampling temperature (RL samples at 1)


def run_arm(arm: str, seed: int, args: argparse.Namespace, out: Path) -> dict:
    """One RL run of ``arm`` on ``seed``: every step's record, the publish-gate verdicts, the settings."""
    import torch

    from vllm_specrl.host import host_info
    from vllm_specrl.rl.draft_trainer import (DraftTrainerProcess, DraftTrainerSettings, publish_gate_verdicts,
                                              trainer_cpus)
    from vllm_specrl.rl.drift import PolicyDrift
    from vllm_specrl.rl.loop import GRPOLoop
    from vllm_specrl.rl.policy import Policy
    from vllm_specrl.rl.serving import serve_args
    from vllm_specrl.rl.tasks import TaskSchedule, held_out_prompts
    from vllm_specrl.launcher import VLLMServer, free_port
    from vllm_specrl.sync.clients.engine_client import EngineClient
    from vllm_specrl.trainer.core import resolve_serving_dtype

    name = f"{arm}_s{seed}"
    work = out / "work" / name
    shutil.rmtree(work, ignore_errors=True)
    policy_dir = work / "policy"
    shutil.copytree(args.target, policy_dir)
    online = arm.startswith("online")
    proposer = PROPOSER[arm]
    serving = serve_args(proposer, k=args.k, draft=args.draft if proposer == "eagle3" else None, adaptive_k=False,
                         capture=f"tcp://127.0.0.1:{free_port()}" if online else None,
                         dtype=resolve_serving_dtype(args.dtype), max_model_len=1024, seed=seed)
    schedule = TaskSchedule(args.task, args.prompts, seed, args.switch_task, args.switch_at)
    policy = Policy(policy_dir, args.lr, seed)
    drift = PolicyDrift(policy.model, held_out_sequences(policy, held_out_prompts(args.task), seed, args.max_tokens))
    steps: list[dict] = []
    trainer = None
    t_start = time.perf_counter()
    with VLLMServer(policy_dir, serving.args, log_path=work / "serve.log", enforce_eager=True) as srv:
        client = EngineClient(srv.url, progress=False)
        if online:
            settings = DraftTrainerSettings(
                publish_every=10**9 if args.block_publishes else args.draft_publish_every, lr=args.draft_lr,
                tv_weight=args.draft_tv_weight, replay_ratio=args.draft_replay_ratio,
                holdout_every=args.draft_holdout_every, keep_versions=args.draft_keep_versions,
                rest_after_hold=args.draft_rest_after_hold, rest_backoff_max=args.draft_rest_backoff_max,
                yields=args.draft_trainer_yields, sched_idle=args.draft_trainer_yields,
                niceness=19 if args.draft_trainer_yields else 0)
            trainer = DraftTrainerProcess.start(serving.capture, srv.url, args.draft, policy_dir, work, settings,
                                                cpus=trainer_cpus("auto", client.status()), name=name)
        loop = GRPOLoop(client, srv.model, policy, schedule.tasks, schedule.score, steps=args.steps,
                        group=args.group, max_tokens=args.max_tokens, clip=args.clip, seed=seed,
                        policy_lag=1 if arm.endswith("-async") else 0, draft_trainer=trainer,
                        trainer_yields=args.draft_trainer_yields,
                        temperature=LOSSY_TEMPERATURE if arm == "lossy" else 1.0)
        try:
            with loop:
                for i in range(args.steps):
                    result = loop.step(i)
                    rec = step_record(result, schedule.task_at(i), drift.kl(policy.model), trainer)
                    steps.append(rec)
                    print_step(name, rec, args.steps, time.perf_counter() - t_start)
                    (out / "runs" / f"{name}.partial.json").write_text(json.dumps({"steps": steps}))
        finally:
            if trainer is not None and not trainer.stop():
                print(f"[rl-run {name}] the draft trainer did not exit after SIGINT: killed", flush=True)
        final = (final_drafts_eval(client, srv, policy, held_out_prompts(schedule.task_at(args.steps - 1)), args, seed)
                 if proposer == "eagle3" and steps else None)
    shutil.rmtree(policy_dir, ignore_errors=True)  # a checkpoint's worth of disk per run; the logs stay
    return {"arm": arm, "seed": seed, "host": host_info(), "settings": run_settings(args), "steps": steps,
            "seconds": time.perf_counter() - t_start, "torch_threads": torch.get_num_threads(),
            "publish_gate": publish_gate_verdicts(trainer.log) if trainer is not None else None,
            "final_drafts_eval": final,
            "serve_args": serving.args}


def final_drafts_eval(client, srv, policy, prompts: list[str], args: argparse.Namespace, seed: int) -> dict:
    """On the run's final policy, the draft it ended with and the starting draft, served in turn on the same
    held-out prompts (T = 1, ``FINAL_EVAL_GROUP`` answers each, the same seeds): served acceptance of both
    drafts on one policy, which the arms' step figures cannot give (each arm's policy took its own path)."""
    from safetensors.torch import load_file

    from vllm_specrl import metrics
    from vllm_specrl.rl.rollouts import sample_groups

    chats = [policy.chat(p) for p in prompts]

    def served() -> dict:
        before = client.status()["spec_decode"]
        samples, _ = sample_groups(srv.url, srv.model, chats, FINAL_EVAL_GROUP, args.max_tokens,
                                   10**6 + seed * 1000, -1, lambda i, text: 0.0)
        out = metrics.summary_delta(before, client.status()["spec_decode"])
        return {**out, "tokens": sum(len(s["completion_ids"]) for s in samples)}

    out = {"prompts": len(prompts), "group": FINAL_EVAL_GROUP, "ended_with": served(),
           "ended_with_version": client.status()["versions"]["draft"]}
    if out["ended_with_version"] == 0:
        out["starting"] = out["ended_with"]  # the starting draft served throughout
        return out
    try:  # an evaluation that fails must not lose the run it follows
        starting = load_file(str(Path(args.draft) / "model.safetensors"))
        client.update_draft(starting, version=out["ended_with_version"] + 1)
        out["starting"] = served()
    except Exception as err:  # noqa: BLE001 - recorded in the run's JSON
        out["starting_error"] = repr(err)
    return out


FINAL_EVAL_GROUP = 16


def held_out_sequences(policy, prompts: list[str], seed: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The starting policy's own answer to each held-out prompt (sampled at T = 1 by the HF model, seeded, so
    every arm measures its drift on the same text)."""
    import torch

    out = []
    for j, prompt in enumerate(prompts):
        ids = policy.tok(policy.chat(prompt), return_tensors="pt")["input_ids"]
        torch.manual_seed(seed * 1000 + j)
        with torch.no_grad():
            gen = policy.model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                        max_new_tokens=min(max_tokens, 96), pad_token_id=policy.tok.eos_token_id)
        out.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    return out


def step_record(result, task: str, kl: float, trainer) -> dict:
    """What the report keeps of one step."""
    from vllm_specrl.rl.tasks import style_summary

    samples, served = result.samples, result.served
    diffs = result.on_policy_logprob_abs_diff()
    tokens = sum(len(s["completion_ids"]) for s in samples)
    return {"step": result.step, "task": task, "mean_reward": sum(s["reward"] for s in samples) / len(samples),
            "rewards": [s["reward"] for s in samples], "kl_from_start": kl,
            "style": style_summary([s["text"] for s in samples]),
            "mean_completion_tokens": tokens / len(samples), "tokens": tokens,
            "generation_s": result.generation["generation_s"], "exposed_generation_s": result.exposed_generation_s,
            "generation_ms_per_token": 1000 * result.generation["generation_s"] / max(1, tokens),
            "logprob_s": result.logprob_s, "training_s": result.training_s, "sync_s": result.sync_s,
            "step_s": result.step_s, "loss": result.loss,
            "acceptance_length": served["acceptance_length"],
            "per_position_acceptance": served["per_position_acceptance"],
            "num_drafts": served["num_drafts"], "num_accepted_tokens": served["num_accepted_tokens"],
            "draft_version": result.status["versions"]["draft"], "policy_version": result.status["versions"]["policy"],
            "on_policy_rollouts": len(diffs),
            "on_policy_logprob_abs_diff_max": float(max(d.max() for d in diffs)) if diffs else None,
            "on_policy_logprob_abs_diff_mean": (float(sum(d.sum() for d in diffs) / sum(d.numel() for d in diffs))
                                                if diffs else None),
            "trainer_cpu_s": process_cpu_s(trainer.proc.pid) if trainer is not None else None}


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (the online trainer's training time so far)."""
    import psutil

    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def print_step(name: str, rec: dict, steps: int, elapsed_s: float) -> None:
    done = rec["step"] + 1
    al = rec["acceptance_length"]
    pos = "/".join(f"{p:.2f}" for p in rec["per_position_acceptance"])
    print(f"[rl-run {name}] step {done}/{steps} ({rec['task']}): reward {rec['mean_reward']:.2f}, "
          f"KL {rec['kl_from_start']:.4f}, {rec['style']['words']:.0f} words, "
          + (f"AL {al:.2f} (positions {pos}), draft v{rec['draft_version']}, " if al is not None else "")
          + f"{rec['generation_ms_per_token']:.1f} ms/token, step {rec['step_s']:.1f}s, "
          f"ETA {(steps - done) * elapsed_s / done / 60:.1f} min", flush=True)


def run_settings(args: argparse.Namespace) -> dict:
    """The settings a finished run must share with the benchmark resuming it."""
    keep = ("task", "switch_task", "switch_at", "steps", "prompts", "group", "max_tokens", "lr", "clip", "k",
            "dtype", *TRAINER_OPTIONS)
    return {k: getattr(args, k) for k in keep} | {"target": str(args.target), "draft": str(args.draft)}


# The online trainer's options, each with the value a run recorded before the option existed ran with (None:
# as this invocation's).
TRAINER_OPTIONS = {"draft_lr": 2e-4, "draft_publish_every": None, "draft_holdout_every": None,
                   "draft_replay_ratio": 4.0, "draft_tv_weight": 0.0, "block_publishes": False,
                   "draft_keep_versions": 1,
                   "draft_rest_after_hold": True, "draft_rest_backoff_max": 8,
                   "draft_trainer_yields": True}


def same_settings(recorded: dict, wanted: dict, arm: str) -> bool:
    """Whether a recorded run was made as this invocation would make it: the online trainer's options count
    only for online arms, and an option the recording predates counts at its default."""
    def relevant(settings: dict) -> dict:
        out = {k: v for k, v in settings.items() if arm.startswith("online") or k not in TRAINER_OPTIONS}
        if arm.startswith("online"):
            for key, default in TRAINER_OPTIONS.items():
                out.setdefault(key, wanted[key] if default is None else default)
        return out
    return relevant(recorded) == relevant(wanted)


def run_in_own_process(arm: str, seed: int, argv: list[str], out: Path) -> dict:
    """One (arm, seed) in a fresh interpreter; its JSON when it ends."""
    path = out / "runs" / f"{arm}_s{seed}.json"
    code = subprocess.call([sys.executable, os.path.abspath(__file__), *argv, "--_one", f"{arm}:{seed}"])
    if code != 0 or not path.exists():
        raise RuntimeError(f"the {arm} run on seed {seed} failed (exit code {code}); see its output above")
    return json.loads(path.read_text())


def finished_run(path: Path, args: argparse.Namespace, arm: str) -> dict | None:
    """A run an earlier invocation finished with the same settings (resumed, not rerun)."""
    if not path.exists():
        return None
    run = json.loads(path.read_text())
    return run if same_settings(run.get("settings", {}), run_settings(args), arm) else None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--target", type=Path, default=None, help="the policy checkpoint (default: the real fixture)")
    ap.add_argument("--draft", type=Path, default=None,
                    help="the EAGLE-3 draft every speculative arm starts from (make rl-run: the demo's draft)")
    ap.add_argument("--arms", default=None, help=f"comma list of {', '.join(ARMS)} (default: {DEFAULTS['arms']})")
    ap.add_argument("--seeds", default=None,
                    help=f"comma list of seeds (default: {DEFAULTS['seeds']}; the RL-level test needs three)")
    ap.add_argument("--task", default="concise", help="the RL task (vllm_specrl.rl.tasks.TASKS)")
    ap.add_argument("--switch-task", default=None,
                    help=f"a second task, from --switch-at on (default: {DEFAULTS['switch_task']})")
    ap.add_argument("--switch-at", type=int, default=None,
                    help=f"the step the second task starts at (default: {DEFAULTS['switch_at']})")
    ap.add_argument("--no-switch", action="store_true", help="one task throughout")
    ap.add_argument("--steps", type=int, default=None, help=f"RL steps per run (default: {DEFAULTS['steps']})")
    ap.add_argument("--prompts", type=int, default=None, help=f"prompts per step (default: {DEFAULTS['prompts']})")
    ap.add_argument("--group", type=int, default=None,
                    help=f"samples per prompt, GRPO's group (default: {DEFAULTS['group']})")
    ap.add_argument("--max-tokens", type=int, default=None, help=f"default: {DEFAULTS['max_tokens']}")
    ap.add_argument("--lr", type=float, default=5e-5,
                    help="the policy's learning rate (AdamW; at 2e-5 SmolLM2 learned the default task too slowly)")
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step, fixed (acceptance compares across arms)")
    ap.add_argument("--dtype", default="auto", help="serving dtype (auto: bf16 where the CPU multiplies it natively)")
    ap.add_argument("--draft-lr", type=float, default=2e-4)
    ap.add_argument("--draft-publish-every", type=int, default=None,
                    help="the online trainer publishes every N of its steps "
                         f"(default: {DEFAULTS['draft_publish_every']})")
    ap.add_argument("--draft-holdout-every", type=int, default=None,
                    help="the online trainer's publish gate holds out every n-th rollout (default: "
                         f"{DEFAULTS['draft_holdout_every']}; 0: publish on schedule, no gate)")
    ap.add_argument("--draft-replay-ratio", type=float, default=4.0)
    ap.add_argument("--draft-tv-weight", type=float, default=0.0)
    ap.add_argument("--draft-keep-versions", type=int, default=4,
                    help="the online trainer keeps this many policy versions' rollouts in its replay buffer "
                         "(train-draft --keep-versions; its own default, 1, left the draft behind a moving policy: "
                         "docs/staleness.md)")
    ap.add_argument("--draft-rest-after-hold", action=argparse.BooleanOptionalAction, default=False,
                    help="the online trainer rests (back to the served draft, for 1, 2, 4, ... policy versions) "
                         "after its gate holds a candidate (train-draft's default; off here: a moving policy "
                         "outruns the rests)")
    ap.add_argument("--draft-rest-backoff-max", type=int, default=8,
                    help="each hold in a row doubles the online trainer's rest, up to this many policy versions")
    ap.add_argument("--draft-trainer-yields", action=argparse.BooleanOptionalAction, default=None,
                    help="the online trainer takes only the cycles the engine and the policy leave (nice 19, "
                         "SCHED_IDLE, paused for the policy phases; default); off: it trains throughout at normal "
                         "priority (--quick: its few short steps leave an idle trainer too little time to publish)")
    ap.add_argument("--block-publishes", action="store_true",
                    help="plant: the online trainer never publishes (the quick variant must then fail)")
    ap.add_argument("--window", type=int, default=None,
                    help=f"steps per window in the report (default: {DEFAULTS['window']})")
    ap.add_argument("--quick", action="store_true",
                    help="the mechanics in minutes (the slower test tier): plain, frozen and online on seeds 0 and 1, "
                         f"{QUICK['steps']} short steps, a task switch at step {QUICK['switch_at']}, the online "
                         "trainer publishing on schedule (no gate), windows of 2")
    ap.add_argument("--out", type=Path, default=Path("results/rl_run"))
    ap.add_argument("--_one", default=None, help=argparse.SUPPRESS)  # ARM:SEED, run in this process
    return ap


# What a run takes unless told otherwise, and what --quick takes instead (options left unset on the command line)
DEFAULTS = {"arms": "frozen,online", "seeds": "0", "steps": 30, "prompts": 4, "group": 8, "max_tokens": 128,
            "switch_task": "concise-minus", "switch_at": 18, "draft_holdout_every": 4, "draft_publish_every": 4,
            "window": 5,
            "draft_trainer_yields": True}
# --quick: every mechanism of a run (policy moves, a switch, publishes, counters, the RL-level test) in minutes
QUICK = {"arms": "plain,frozen,online", "seeds": "0,1", "steps": 6, "prompts": 2, "group": 4, "max_tokens": 64,
         "switch_task": "concise-minus", "switch_at": 3, "draft_holdout_every": 0, "draft_publish_every": 2,
         "window": 2, "draft_trainer_yields": False}


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    for key, value in DEFAULTS.items():  # --quick's values, or the defaults, where the command line set none
        if getattr(args, key) is None:
            setattr(args, key, QUICK.get(key, value) if args.quick else value)
    if args.no_switch:
        args.switch_task = args.switch_at = None
    from vllm_specrl.fixtures import fixture_target

    args.target = (args.target or Path(fixture_target("real", args.fixtures))).resolve()
    if args.draft is None and any(PROPOSER[a] == "eagle3" for a in args.arms.split(",") if a in PROPOSER):
        raise SystemExit("--draft is needed for the frozen and online arms (make rl-run builds the demo's draft)")
    args.draft = args.draft.resolve() if args.draft else None
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    if args._one:
        arm, seed = args._one.split(":")
        run = run_arm(arm, int(seed), args, args.out)
        (args.out / "runs" / f"{arm}_s{seed}.json").write_text(json.dumps(run, indent=1))
        (args.out / "runs" / f"{arm}_s{seed}.partial.json").unlink(missing_ok=True)
        return run
    arms, seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; choose from {ARMS}")
    child_argv = list(argv if argv is not None else sys.argv[1:])
    runs = []
    for seed in seeds:
        for arm in arms:
            path = args.out / "runs" / f"{arm}_s{seed}.json"
            run = finished_run(path, args, arm)
            if run is None:
                print(f"[rl-run] {arm} on seed {seed}: {args.steps} steps", flush=True)
                run = run_in_own_process(arm, seed, child_argv, args.out)
            else:
                print(f"[rl-run] {arm} on seed {seed}: finished earlier ({path})", flush=True)
            runs.append(run)
    report = build_report(runs, window=args.window, switch_at=args.switch_at)
    png = args.out / "rl_run.png"
    plot(report, png)
    report["plot"] = str(png)
    (args.out / "rl_run.json").write_text(json.dumps(report, indent=1))
    print_summary(report)
    print(f"wrote {args.out / 'rl_run.json'} and {png}")
    return report


if __name__ == "__main__":
    main()
