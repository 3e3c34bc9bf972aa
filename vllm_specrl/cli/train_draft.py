"""``vllm-specrl train-draft``: an EAGLE-3 draft warm-started from the target's own rollouts (``--offline``), or
trained online from the hidden states ``vllm serve`` streams (``--capture``), publishing back to the engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_specrl.cli.drafts import add_target_layer

if TYPE_CHECKING:
    from vllm_specrl.trainer.core import TrainConfig


def train_config(args: argparse.Namespace) -> TrainConfig:
    from vllm_specrl.trainer.core import TrainConfig

    # With --mtp one position by default: the chain pays once the first position has converged, and
    # each chained step costs a multiple of a one-position step (docs/mtp.md).
    ttt_steps = args.ttt_steps if args.ttt_steps is not None else (1 if args.mtp else 3)
    return TrainConfig(lr=args.lr, ttt_steps=ttt_steps, seed=args.seed, decay=args.decay,
                       tv_weight=args.tv_weight, accept_weighted=args.accept_weighted,
                       mixed_precision=args.mixed_precision, lr_schedule=args.lr_schedule,
                       warmup_steps=args.warmup_steps, total_steps=args.steps,
                       weight_decay=args.weight_decay, feature_noise=args.feature_noise,
                       start_anchor=args.start_anchor, device=args.device)


def run_online(args: argparse.Namespace) -> int:
    from vllm_specrl.trainer.online import OnlineConfig, OnlineDraftTrainer

    if args.lr_schedule != "constant":
        print("error: --lr-schedule applies to --offline warm starts (online training has no end "
              "for a schedule to decay towards)", file=sys.stderr)
        return 2
    cfg = OnlineConfig(capture=args.capture, engine=args.engine, api_key=args.api_key,
                       batch_size=args.batch_size, publish_every=args.publish_every,
                       checkpoint_every=args.checkpoint_every, max_steps=args.max_steps,
                       max_seconds=args.max_seconds, idle_s=args.idle_s, seed=args.seed,
                       replay_ratio=args.replay_ratio, capture_allow_remote=args.capture_allow_remote,
                       pause_file=str(args.pause_file) if args.pause_file else None,
                       holdout_every=args.holdout_every, publish_margin=args.publish_margin,
                       rest_after_hold=args.rest_after_hold,
                       rest_sequences=args.rest_sequences, rest_backoff_max=args.rest_backoff_max,
                       keep_versions=args.keep_versions, drafter="mtp" if args.mtp else "eagle3")
    trainer = OnlineDraftTrainer(args.draft, args.target, cfg, train_config(args), args.checkpoint_dir, args.log)
    print(json.dumps({"event": "started", "resumed_from_step": trainer.resumed_from_step,
                      "checkpoint_dir": str(trainer.checkpoint_dir)}), flush=True)
    # SIGINT/SIGTERM end the loop between steps (checkpoint saved, sockets closed) instead of
    # raising wherever the main thread happens to be: inside a publish, a ZeroMQ poll or a
    # worker-thread join, where an exit could wait on a slow request for minutes.
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: trainer.stop_requested.set())
    try:
        summary = trainer.run()
    except KeyboardInterrupt:
        trainer.trainer.save(trainer.checkpoint_dir, extra={"draft_version": trainer.draft_version})
        summary = {"event": "interrupted", "steps": trainer.trainer.step_count}
    finally:
        trainer.close()
    print(json.dumps(summary), flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    from vllm_specrl.cpu.malloc import keep_every_block_on_heap

    keep_every_block_on_heap()  # a training process: its pages are reused step after step
    if args.feature_noise < 0 or args.weight_decay < 0 or args.start_anchor < 0:
        print("error: --feature-noise, --weight-decay and --start-anchor must be >= 0", file=sys.stderr)
        return 2
    if args.mtp and args.feature_noise:
        print("error: --feature-noise applies to EAGLE-3 drafts (an MTP layer reads the policy's final "
              "hidden state, which it is trained to follow exactly)", file=sys.stderr)
        return 2
    if args.mtp and args.start_anchor:
        print("error: --start-anchor applies to EAGLE-3 drafts (the MTP trainer decays toward zero only: "
              "--weight-decay)", file=sys.stderr)
        return 2
    if args.mtp and args.device not in ("auto", "cpu"):
        print("error: --mtp trains on the CPU (one MTP layer; --device applies to EAGLE-3 drafts)", file=sys.stderr)
        return 2
    from vllm_specrl.trainer.placement import resolve_device

    try:
        resolve_device(args.device)
    except ValueError as exc:
        print(f"error: --device: {exc}", file=sys.stderr)
        return 2
    if args.engine_args is not None and (args.capture or not isinstance(args.engine_args, dict)):
        print("error: --engine-args is a JSON object of vLLM engine arguments, for --offline", file=sys.stderr)
        return 2
    if args.capture:
        return run_online(args)
    if args.mtp and not args.capture:
        print("error: --mtp trains online (with --capture): an MTP layer's warm start is the policy's own",
              file=sys.stderr)
        return 2
    if not args.offline:
        print("error: pass --offline (warm start from the target's rollouts) or --capture ADDR "
              "(online, from hidden states streamed by vllm serve)", file=sys.stderr)
        return 2
    from vllm_specrl.trainer.core import resolve_serving_dtype
    from vllm_specrl.trainer.offline import OfflineConfig, warm_start

    prompts = None
    if args.prompts:
        lines = Path(args.prompts).read_text().splitlines()
        prompts = [json.loads(ln)["prompt"] if ln.startswith("{") else ln for ln in lines if ln.strip()]
    cfg = OfflineConfig(num_prompts=args.num_prompts, samples_per_prompt=args.samples,
                        max_tokens=args.max_tokens, steps=args.steps, batch_size=args.batch_size,
                        seed=args.seed, chat=not args.raw_prompts, dtype=resolve_serving_dtype(args.dtype),
                        eval_fraction=args.eval_fraction, eval_every=args.eval_every, task=args.task,
                        features=args.features, group_by_length=args.group_by_length,
                        parallel_drafting=args.parallel_drafting, target_layer=args.target_layer,
                        engine_args=args.engine_args or {})
    summary = warm_start(args.target, args.draft, prompts, cfg, train_config(args), args.draft_vocab_size,
                         args.init_from, args.log, args.rollouts)
    print(json.dumps(summary, indent=2))
    return 0



def add_commands(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser("train-draft", help="train an EAGLE-3 draft (--offline warm start, or "
                        "online with --capture)")
    _add_mode_and_online_options(tr)
    _add_checkpoint_and_data_options(tr)
    _add_optimiser_options(tr)
    _add_rollout_engine_options(tr)
    tr.set_defaults(func=run)


def _add_mode_and_online_options(tr: argparse.ArgumentParser) -> None:
    tr.add_argument("--offline", action="store_true", help="warm start from the target's own rollouts")
    tr.add_argument("--capture", default=None, help="online: ZeroMQ address to receive capture frames on")
    tr.add_argument("--capture-allow-remote", action="store_true",
                    help="online: allow a non-loopback --capture address (hidden states from other hosts)")
    tr.add_argument("--engine", default=None,
                    help="online: vllm serve URL to publish the draft to (several: comma-separated)")
    tr.add_argument("--api-key", default=None)
    tr.add_argument("--publish-every", type=int, default=20)
    tr.add_argument("--checkpoint-every", type=int, default=50)
    tr.add_argument("--checkpoint-dir", type=Path, default=None, help="online: default <draft>-online")
    tr.add_argument("--max-steps", type=int, default=None)
    tr.add_argument("--max-seconds", type=float, default=None)
    tr.add_argument("--idle-s", type=float, default=1.0, help="online: a request quiet this long is done")
    tr.add_argument("--replay-ratio", type=float, default=None,
                    help="online: train on at most this many samples per captured sequence, then idle "
                         "until new ones arrive (default: train continuously on the replay buffer)")
    tr.add_argument("--pause-file", type=Path, default=None,
                    help="online: while this file exists, ingest captured frames but neither train nor publish "
                         "(an RL loop sharing the machine creates it for its policy phases)")
    tr.add_argument("--holdout-every", type=int, default=4,
                    help="online: hold every n-th captured rollout out of training and publish a draft only "
                         "when its estimated acceptance on them beats the served draft's (0: publish every "
                         "--publish-every steps unconditionally)")
    tr.add_argument("--publish-margin", type=float, default=0.0,
                    help="online: acceptance length a draft must gain on the held-out rollouts to be published")
    tr.add_argument("--rest-after-hold", action=argparse.BooleanOptionalAction, default=True,
                    help="online: when the gate holds a candidate as not better, return to the served draft's "
                         "weights and train no more until the next policy version or --rest-sequences new "
                         "rollouts, longer after each hold in a row (--rest-backoff-max) "
                         "(--no-rest-after-hold: keep training the held candidate)")
    tr.add_argument("--rest-sequences", type=int, default=32,
                    help="online: a rest also ends after this many newly captured rollouts (0: only a new "
                         "policy version ends it)")
    tr.add_argument("--rest-backoff-max", type=int, default=8,
                    help="online: each hold in a row doubles the next rest (1, 2, 4, ... policy versions, and "
                         "as many times --rest-sequences rollouts) up to this many versions; a publish resets it "
                         "(1: every new policy version ends a rest)")
    tr.add_argument("--keep-versions", type=int, default=1,
                    help="online: keep the captured rollouts of this many policy versions in the replay buffer "
                         "(1: the current version's alone; more: several RL steps of data while the policy moves)")
    tr.add_argument("--mtp", action="store_true",
                    help="online: train the policy's own MTP layer (an engine serving \"method\": \"mtp\"); "
                         "--draft is then the checkpoint holding the MTP layer to start from (the policy's)")


def _add_checkpoint_and_data_options(tr: argparse.ArgumentParser) -> None:
    tr.add_argument("--target", type=Path, required=True)
    tr.add_argument("--draft", type=Path, required=True,
                    help="draft directory (offline: output; online: the draft the engine serves)")
    tr.add_argument("--init-from", type=Path, default=None, help="start from this draft")
    add_target_layer(tr, default="last")
    tr.add_argument("--rollouts", type=Path, default=None,
                    help="offline: reuse a warm start's saved rollouts (warm_start_rollouts.json)")
    tr.add_argument("--prompts", type=Path, default=None, help="text or JSONL ({\"prompt\":...}) file")
    tr.add_argument("--raw-prompts", action="store_true", help="do not apply the chat template")
    tr.add_argument("--num-prompts", type=int, default=64)
    tr.add_argument("--task", default="chat", choices=["chat", "arithmetic", "explain"],
                    help="offline: built-in prompt family when --prompts is not given (explain: the RL "
                         "demo's own task)")
    tr.add_argument("--samples", type=int, default=4, help="rollouts per prompt")
    tr.add_argument("--max-tokens", type=int, default=128)
    tr.add_argument("--steps", type=int, default=300)
    tr.add_argument("--batch-size", type=int, default=8)
    tr.add_argument("--group-by-length", action="store_true",
                    help="offline: batch rollouts of similar length, --batch-size x the mean length in "
                         "padded tokens per batch (RL answers vary: random batches are mostly padding)")
    tr.add_argument("--parallel-drafting", action="store_true",
                    help="offline: train (or, with --init-from, convert and train) a draft for vLLM's parallel "
                         "drafting (P-EAGLE: all k drafts from one forward pass; serve it with "
                         "\"parallel_drafting\": true in --speculative-config)")


def _add_optimiser_options(tr: argparse.ArgumentParser) -> None:
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                    help="offline: cosine decays to 0.1 lr over --steps after --warmup-steps "
                         "(online training never ends, so it stays constant)")
    tr.add_argument("--warmup-steps", type=int, default=0)
    tr.add_argument("--ttt-steps", type=int, default=None,
                    help="draft positions trained on the draft's own chain (training-time test); "
                         "default 3, with --mtp 1")
    tr.add_argument("--decay", type=float, default=0.8, help="weight of TTT step k is decay**k")
    tr.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's decoupled weight decay")
    tr.add_argument("--start-anchor", type=float, default=0.0,
                    help="decoupled decay toward the draft's starting weights instead of zero: each step "
                         "moves every weight lr times this of the way back to its start")
    tr.add_argument("--feature-noise", type=float, default=0.0,
                    help="training only: Gaussian noise on the target's hidden-state features, this many "
                         "times each channel's standard deviation (EAGLE's feature noise)")
    tr.add_argument("--tv-weight", type=float, default=0.0,
                    help="add this times TV(p, q) = 1 - acceptance at T=1 to the loss")
    tr.add_argument("--accept-weighted", action="store_true",
                    help="weight TTT step k by the probability that vLLM reaches it (on-policy contexts)")
    tr.add_argument("--eval-fraction", type=float, default=0.1,
                    help="offline: share of prompts held out (all their rollouts) for evaluation")
    tr.add_argument("--eval-every", type=int, default=0,
                    help="offline: evaluate on the held-out prompts every N steps (learning curve)")
    tr.add_argument("--draft-vocab-size", type=int, default=None)
    tr.add_argument("--mixed-precision", choices=["no", "bf16", "auto"], default="no",
                    help="draft training precision: fp32, bf16 autocast, or auto (bf16 where the CPU or GPU "
                         "multiplies bf16 natively: AVX512-BF16, AMX, CUDA)")
    tr.add_argument("--device", default="auto",
                    help="where the trainer runs: auto (the visible GPU with the most free memory, else the CPU), "
                         "cpu, cuda or cuda:N; --mtp trains on the CPU (docs/capture-and-online-training.md)")


def _add_rollout_engine_options(tr: argparse.ArgumentParser) -> None:
    tr.add_argument("--engine-args", type=json.loads, default=None, metavar="JSON",
                    help="offline: vLLM engine arguments for the engine that generates the rollouts, over the "
                         'defaults (e.g. \'{"tensor_parallel_size": 8, "gpu_memory_utilization": 0.5}\')')
    tr.add_argument("--dtype", default="float32",
                    help="vLLM dtype for generating rollouts, whose hidden states the draft trains on; auto: "
                         "bfloat16 where this CPU multiplies bf16 natively (what `make demo` serves), else float32")
    tr.add_argument("--features", choices=["capture", "hf"], default="capture",
                    help="offline: target hidden states captured from vLLM while it generates (default), "
                         "or from a transformers forward afterwards (always with --rollouts)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--log", type=Path, default=None, help="JSONL of per-step metrics")
