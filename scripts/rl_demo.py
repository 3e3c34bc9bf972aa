"""A real (small) GRPO loop with speculative rollouts, and the same loop without, same seeds.

Policy: SmolLM2-135M-Instruct (the real fixture). Task (``vllm_specrl.rl.tasks``): "What is a + b?",
by default ``explain`` (reasoning-style answers of varied length that stop at EOS, so each step
ends in a small-batch tail; reward 1 when the last number is the sum) or ``arithmetic`` (short
answers). The loop is ``vllm_specrl.rl``'s: the engine served with ``rl.serving.serve_args``, the
online draft trainer started with ``rl.draft_trainer``, each step ``rl.loop.GRPOLoop.step``
(rollouts with policy versions, logprobs checked against vLLM's, one GRPO update, the weights
published in place). Runs (``--runs``): ``spec`` (EAGLE-3 draft, capture, online draft trainer,
adaptive k), ``history`` (the rollout-history proposer), ``mtp`` (the policy's own MTP layer, on the
real-mimo fixture), ``plain``, and their ``-async`` forms (policy lag 1).

Around the loop, this script is a benchmark harness (``demo_harness.py``): each run in its own
process, the runs' steps taken in turn, a plain run replaying the proposer runs' answer lengths,
warm-up steps recorded apart; at the end a table, JSON and a PNG (``demo_report.py``).

    python scripts/rl_demo.py --fixtures .fixtures            # both runs, defaults
    python scripts/rl_demo.py --runs spec,plain,spec-async --task arithmetic --max-tokens 16
    python scripts/rl_demo.py --runs spec,history,plain --dataset-size 8   # EAGLE-3 and history
    python scripts/rl_demo.py --proposer mtp                            # the policy's own MTP layer
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from vllm_specrl.cpu import malloc as cpu_malloc
from vllm_specrl.adaptive.k_sweep import WARM_UP_TOKENS
from vllm_specrl.rl.draft_trainer import DraftTrainerProcess, pause_file, publish_gate_verdicts, trainer_cpus
from vllm_specrl.rl.loop import GRPOLoop
from vllm_specrl.rl.policy import Policy
from vllm_specrl.rl.serving import serve_args
from vllm_specrl.rl.tasks import TASKS, make_tasks, reward
from vllm_specrl.trainer.core import resolve_serving_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness and the report, beside it
from demo_harness import (ParentTurns, clear_stale_run, draft_trainer_settings, next_turn,  # noqa: E402
                          page_faults, policy_paths, read_run, replay_lengths,
                          run_in_own_process, run_interleaved, step_record, warm_up_trainer)
from demo_report import PROPOSERS, plot, print_table, summarize, verdict  # noqa: E402
from vllm_specrl.host import host_info  # noqa: E402


def run(mode: str, args: argparse.Namespace, target: Path, work: Path, replay: dict | None = None,
        turns: ParentTurns | None = None) -> dict:
    """One RL run of ``mode``. ``replay`` (runs before it, by mode): after its steps, this engine
    generates their timed steps' rollouts again at exactly their lengths, and its own. With ``turns``,
    each step waits for the parent's ``{"step": i}``; after the last, ``{"finish": {"replay_of": [...]}}``
    names the runs (their reports in ``work``) whose lengths to replay."""
    from vllm_specrl.proposer.checkpoint import init_draft
    from vllm_specrl.launcher import VLLMServer, free_port
    from vllm_specrl.sync.clients.engine_client import EngineClient

    policy_dir, policy_head = policy_paths(work, mode)
    clear_stale_run(work, mode)
    pause_file(work, mode).unlink(missing_ok=True)
    shutil.copytree(target, policy_dir)
    proposer = {"spec": "eagle3", "history": "history", "mtp": "mtp"}.get(mode.split("-")[0], "plain")
    mtp = proposer == "mtp"
    draft = Path(args.draft) if args.draft else work / "draft"
    if proposer == "eagle3" and not args.draft:
        init_draft(target, draft, args.draft_vocab_size, seed=args.seed)
    online = args.online_draft and proposer in ("eagle3", "mtp")
    serving = serve_args(proposer, k=args.k, draft=draft if proposer == "eagle3" else None,
                         adaptive_k=args.adaptive_k, capture=f"tcp://127.0.0.1:{free_port()}" if online else None,
                         dtype=args.dtype, max_model_len=1024, seed=args.seed,
                         additional={"history": args.history_config} if proposer == "history" and args.history_config
                         else None)
    trainer, calibration = None, None
    policy = Policy(policy_dir, args.lr, args.seed)
    if mtp and online:
        policy.write_head(policy_dir, policy_head)  # what train-draft --mtp reads of the policy
    steps, warm_up, length_replays = [], [], None
    total = args.warm_up_steps + args.steps
    with VLLMServer(policy_dir, serving.args, log_path=work / f"serve_{mode}.log", enforce_eager=not args.compile,
                    startup_timeout_s=900 if args.compile else 300) as srv:
        client = EngineClient(srv.url, progress=False)
        if args.calibrate:
            # Before the trainer starts (its capture must not see the sweep); on a plain engine the same
            # requests are its warm-up, and the history proposer (no steady steps to measure) gets one too.
            calibration = client.calibrate_adaptive_k(max_batch=args.prompts * args.group,
                                                      steps=WARM_UP_TOKENS if proposer == "history" else 256)
            print(f"[rl:{mode}] calibration {calibration['seconds']:.1f}s: "
                  + ", ".join(f"{b['batch']} seqs -> k {b['best_k']}" for b in calibration["batches"]), flush=True)
        if online:
            trainer = DraftTrainerProcess.start(
                serving.capture, srv.url, policy_dir if mtp else draft, policy_head if mtp else policy_dir, work,
                draft_trainer_settings(args), mtp=mtp, cpus=trainer_cpus(args.draft_trainer_cpus, client.status()),
                name=mode)
        loop = GRPOLoop(client, srv.model, policy,
                        lambda i: make_tasks(i, args.prompts, args.seed, args.task, args.dataset_size),
                        lambda text, answer: reward(text, answer, args.task), steps=total, group=args.group,
                        max_tokens=args.max_tokens, clip=args.clip, seed=args.seed,
                        policy_lag=1 if mode.endswith("-async") else 0, draft_trainer=trainer,
                        trainer_yields=args.draft_trainer_yields,
                        trainer_trains_during=args.draft_trainer_trains_during, keep_mtp=mtp,
                        mtp_head=policy_head if mtp and online else None, checkpoint_dir=policy_dir)
        try:
            with loop:
                # Step i samples task set i and leaves policy version i + 1; the first warm_up_steps are
                # recorded apart (steps -N..-1) and left out of the summary.
                for i in range(total):
                    if turns is not None and next_turn(turns, mode, "step") != i:
                        raise RuntimeError(f"[rl:{mode}] the parent's step index is not {i}")
                    started_at, faults = time.time(), page_faults()
                    result = loop.step(i)
                    rec = step_record(result, args, page_faults() - faults, started_at)
                    (steps if rec["step"] >= 0 else warm_up).append(rec)
                    print_step(mode, rec)
                    if turns is not None:
                        turns.report({"step": rec["step"], "step_s": rec["step_s"]})
            if turns is not None:
                replay = {m: read_run(work, m) for m in next_turn(turns, mode, "finish")["replay_of"]}
            if replay:
                length_replays = replay_lengths(srv.url, srv.model, policy, args,
                                                {**replay, mode: {"steps": steps}}, mode)
        finally:
            if trainer is not None and not trainer.stop():  # a stuck trainer must not fail the RL run
                print(f"[rl:{mode}] draft trainer did not exit in 120 s after SIGINT: killed", flush=True)
    return {"mode": mode, "steps": steps, "warm_up_steps": warm_up, "calibration": calibration,
            "draft_publish_gate": publish_gate_verdicts(work / f"online_draft_{mode}.jsonl"),
            **({"length_replays": length_replays} if length_replays is not None else {})}


def print_step(mode: str, rec: dict) -> None:
    nan = float("nan")
    print(f"[rl:{mode}] {'warm-up ' if rec['step'] < 0 else ''}step {rec['step']}: reward {rec['mean_reward']:.2f}, "
          f"gen {rec['generation_s']:.1f}s (bulk {rec['generation_bulk_s']:.1f}s, tail {rec['generation_tail_s']:.1f}s"
          + (f", mean k {rec['mean_k']:.2f}" if rec["mean_k"] is not None else "") + ") "
          f"(exposed {rec['exposed_generation_s']:.1f}s), logp {rec['logprob_s']:.1f}s, "
          f"train {rec['training_s']:.1f}s, "
          f"sync {rec['sync_s']:.1f}s, step {rec['step_s']:.1f}s, accept {rec['acceptance_length'] or nan:.2f} "
          f"(first draft {rec['accept_pos0'] if rec['accept_pos0'] is not None else nan:.3f}), "
          f"versions {rec['rollout_policy_versions']}, |dlogp| max {rec['logprob_abs_diff_max']:.3f}", flush=True)


def history_config_arg(text: str) -> dict:
    """``--history-config``: a JSON object of the history proposer's knobs, checked before any engine starts."""
    from vllm_specrl.proposer.history_index import HistoryConfig

    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("expected a JSON object")
        HistoryConfig.from_dict(raw)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    return raw


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
                    help="RL steps each run takes before its timed ones (a long RL job's steady state: the first "
                         "step pays start-up costs); recorded under warm_up_steps, left out of the summary")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--task", default="explain", choices=TASKS,
                    help="arithmetic: short answers; explain: reasoning-style answers of varied length")
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="the answers' cap (explain answers vary in length, so each step ends in a tail)")
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
                         "two runs' answers ran (it adds a plain run of every step's rollouts)")
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
    ap.add_argument("--history-config", type=history_config_arg, default=None, metavar="JSON",
                    help="the history runs' proposer knobs (other runs ignore them), as under --additional-config's "
                         "specrl.history (e.g. '{\"cost_aware\": false, \"min_confidence\": 0.1}': a fixed threshold "
                         "instead of the one fitted from the engine's step times)")
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft to start from (default: fresh)")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--draft-replay-ratio", type=float, default=4.0,
                    help="online draft trainer: samples trained per captured rollout")
    ap.add_argument("--online-draft", action=argparse.BooleanOptionalAction, default=True,
                    help="capture the policy's states and train the draft online; --no-online-draft serves the "
                         "starting draft frozen (no capture, no trainer)")
    ap.add_argument("--draft-lr", type=float, default=2e-4,
                    help="online draft trainer's learning rate (fine-tuning a warm-started draft)")
    ap.add_argument("--draft-tv-weight", type=float, default=0.0,
                    help="online draft trainer: add this times TV(p, q), 1 - the acceptance at T=1, to its "
                         "cross-entropy")
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
                         "update and sync phases, which share this machine's cores (on a GPU cluster it has "
                         "its own device)")
    ap.add_argument("--draft-trainer-trains-during", choices=["rollouts", "policy"], default="rollouts",
                    help="when the online draft trainer trains: during the rollouts (it takes the cycles generation "
                         "leaves), or during the policy's logprob, update and sync phases (generation then shares "
                         "its cores with capture alone); it ingests captured rows throughout")
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
                         "natively, AVX512-BF16 or AMX; float32 elsewhere, where bf16 matmuls are emulated)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                    help="serve every run with vLLM's torch.compile (its default; about a minute more per engine "
                         "start) instead of eager mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/rl_demo.json"))
    return ap




def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.draft_trainer_trains_during == "policy" and not args.draft_trainer_yields:
        parser.error("--draft-trainer-trains-during policy pauses the trainer for the rollouts: "
                     "leave --draft-trainer-yields on")
    cpu_malloc.keep_every_block_on_heap()  # the policy's log-prob pass and update (vllm_specrl.cpu.malloc)
    args.dtype = resolve_serving_dtype(args.dtype or "auto")
    if args.proposer:
        args.runs = {"history": "history,plain", "mtp": "mtp,plain"}.get(args.proposer, "spec,plain")

    from vllm_specrl.fixtures import fixture_target

    wants_mtp = any(m.startswith("mtp") for m in args.runs.split(","))
    target = args.target or Path(fixture_target("real-mimo" if wants_mtp else "real", args.fixtures))
    work = args.work_dir or args.out.parent / (args.out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)
    report = {"demo": "grpo_speculative_rollouts", "host": host_info(),
              "settings": {k: str(v) for k, v in vars(args).items()},
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

        run_interleaved(os.path.abspath(__file__), modes, args.warm_up_steps + args.steps, target, work,
                        to_replay, finished)
        report["runs"] = {m: report["runs"][m] for m in modes}  # in --runs order, as run one after another
    elif args.isolate_runs and len(modes) > 1:
        if args.interleave_runs:
            print("[rl] an async run takes its next rollouts while it trains: the runs go one after another",
                  flush=True)
        for mode in modes:
            report["runs"][mode] = run_in_own_process(os.path.abspath(__file__), mode, target, work, to_replay(mode))
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
    report["verdict"] = verdict(report)
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
