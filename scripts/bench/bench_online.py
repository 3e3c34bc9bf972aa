"""Online adaptation curve: acceptance over rollout rounds while the online trainer runs,
with a policy update in the middle (the dip, and the recovery).

Starts ``vllm serve`` (EAGLE-3 draft freshly initialised, capture on) and
``vllm-specrl train-draft --capture`` beside it, then sends rounds of T=1
traffic. At ``--update-at`` it writes a shifted policy into the trainer's
``--target`` directory and pushes the same weights into the engine with
``EngineClient.update_policy`` (what an RL step does). Per round it records
vLLM's acceptance length, the draft and policy versions and the trainer's
last metrics. Reports the rounds and trainer steps needed to get back to 90%
of the pre-update acceptance. Output: JSON and a PNG.

    python scripts/bench/bench_online.py --fixture tiny --rounds 24 --update-at 12

``--drafter mtp`` (with ``--fixture tiny-mimo``) does the same for a policy that ships
its own MTP layer: the engine serves ``"method": "mtp"``, the trainer runs
``train-draft --mtp``, and the policy update moves the body but carries the MTP
layer unchanged (an RL trainer that does not train it), so the served layer is
stale after the update until the online trainer's next publish.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch
from safetensors.torch import load_file, save_file

from vllm_specrl import metrics
from bench_engine import host_info


def shifted_policy(src: Path, dst: Path, scale: float, seed: int, keep_prefix: str | None = None
                   ) -> dict[str, torch.Tensor]:
    """A policy moved away from ``src`` (every matrix perturbed, except those named ``keep_prefix*``),
    saved as a checkpoint in ``dst``."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    w = load_file(src / "model.safetensors")
    w = {k: (v.float() + scale * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
         if v.dim() == 2 and not (keep_prefix and k.startswith(keep_prefix)) else v for k, v in w.items()}
    save_file(w, dst / "model.safetensors")
    return w


def last_trainer_record(log: Path) -> dict:
    try:
        lines = log.read_text().splitlines()
        return json.loads(lines[-1]) if lines else {}
    except (OSError, json.JSONDecodeError):
        return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--fixture", default="tiny", choices=["real", "tiny", "tiny-mimo"])
    ap.add_argument("--drafter", default="eagle3", choices=["eagle3", "mtp"],
                    help="mtp: the policy's own MTP layer (needs a fixture that has one: tiny-mimo)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--lr", default="3e-3", help="the online trainer's learning rate")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-vocab-size", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--update-at", type=int, default=12)
    ap.add_argument("--shift", type=float, default=0.3, help="policy perturbation (x weight std)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--pause-s", type=float, default=4.0, help="trainer time between rounds")
    ap.add_argument("--out", type=Path, default=Path("results/bench_online.json"))
    args = ap.parse_args()

    from vllm_specrl.fixtures import fixture_target
    from vllm_specrl.proposer.checkpoint import init_draft
    from vllm_specrl.launcher import VLLMServer, free_port
    from vllm_specrl.sync.clients.engine_client import EngineClient

    src = Path(fixture_target(args.fixture, args.fixtures))
    work = args.out.parent / "online_work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    target = work / "policy"  # the trainer's --target, rewritten at the policy update
    shutil.copytree(src, target)
    capture = f"tcp://127.0.0.1:{free_port()}"
    if args.drafter == "mtp":
        draft = target  # the MTP layer lives in the policy checkpoint
        spec = {"method": "mtp", "num_speculative_tokens": args.k, "draft_sample_method": "probabilistic"}
        trainer_args = ["--mtp"]
    else:
        draft = work / "draft"
        init_draft(src, draft, args.draft_vocab_size, seed=0)
        spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": args.k,
                "draft_sample_method": "probabilistic"}
        trainer_args = []
    server_args = ["--dtype", args.dtype, "--max-model-len", "1024", "--speculative-config", json.dumps(spec),
                   "--additional-config", json.dumps({"specrl": {"capture": capture}})]
    log = work / "online.jsonl"
    curve = []
    with VLLMServer(target, server_args, log_path=work / "serve.log") as srv:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "vllm_specrl.cli", "train-draft", "--capture", capture, "--engine", srv.url,
             "--draft", str(draft), "--target", str(target), "--publish-every", "4",
             "--checkpoint-every", "20", "--batch-size", "4", "--lr", args.lr, "--idle-s", "0.5",
             "--checkpoint-dir", str(work / "trainer"), "--log", str(log), *trainer_args],
            stdout=open(work / "trainer.out", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
            env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
        client = EngineClient(srv.url, progress=False)
        prompts = [f"def function_{i}(x):\n    " for i in range(256)]

        def one(p: str) -> None:
            requests.post(srv.url + "/v1/completions", timeout=600, json={
                "model": srv.model, "prompt": p, "max_tokens": args.max_tokens, "temperature": 1.0,
                "ignore_eos": True}).raise_for_status()

        try:
            for r in range(args.rounds):
                if r == args.update_at:
                    weights = shifted_policy(src, target, args.shift, seed=1,
                                             keep_prefix="model.mtp_layers." if args.drafter == "mtp" else None)
                    client.update_policy(weights, version=1)
                before = client.status()["spec_decode"]
                batch = [prompts[(r * args.requests + i) % len(prompts)] for i in range(args.requests)]
                with ThreadPoolExecutor(8) as pool:
                    list(pool.map(one, batch))
                st = client.status()
                served = metrics.summary_delta(before, st["spec_decode"])
                rec = last_trainer_record(log)
                curve.append({"round": r, "acceptance_length": served["acceptance_length"] or 1.0,
                              "accept_pos0": (served["per_position_acceptance"] or [0.0])[0],
                              "trainer_accept_pos0": rec.get("accept_pos0"),
                              "policy_version": st["versions"]["policy"], "draft_version": st["versions"]["draft"],
                              "trainer_step": rec.get("step"), "trainer_loss": rec.get("loss"),
                              "trainer_expected_acceptance_length": rec.get("expected_acceptance_length"),
                              "stale_draft": st["stale_draft"]["stale"]})
                print(f"[online] round {r:2d}: acceptance length {curve[-1]['acceptance_length']:.3f} "
                      f"(policy v{curve[-1]['policy_version']}, draft v{curve[-1]['draft_version']}, "
                      f"trainer step {rec.get('step')})", flush=True)
                time.sleep(args.pause_s)
        finally:
            trainer.send_signal(signal.SIGINT)
            trainer.wait(60)
    pre = [c["acceptance_length"] for c in curve[max(0, args.update_at - 3):args.update_at]]
    pre_level = sum(pre) / len(pre) if pre else None
    recovered = None
    if pre_level:
        for c in curve[args.update_at:]:
            # 90% of the pre-update gain over a no-acceptance baseline of 1.0
            if c["acceptance_length"] - 1 >= 0.9 * (pre_level - 1):
                recovered = c
                break
    update_step = curve[args.update_at]["trainer_step"] if len(curve) > args.update_at else None
    report = {"benchmark": "online_adaptation", "host": host_info(), "fixture": args.fixture, "settings": vars(args) | {
                  "out": str(args.out), "fixtures": str(args.fixtures)},
              "curve": curve, "pre_update_acceptance_length": pre_level,
              "post_update_first_round": (curve[args.update_at]["acceptance_length"] if update_step is not None
                                          else None),
              "recovered_at_round": recovered["round"] if recovered else None,
              "rounds_to_recover_90pct": recovered["round"] - args.update_at if recovered else None,
              "trainer_steps_to_recover_90pct": (recovered["trainer_step"] - update_step)
              if recovered and recovered["trainer_step"] is not None and update_step is not None else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([c["round"] for c in curve], [c["acceptance_length"] for c in curve], marker="o",
            label=f"vLLM acceptance length (T=1, k={args.k})")
    if args.drafter == "mtp":  # the MTP trainer estimates the first position (see vllm_specrl.trainer.mtp)
        ax.plot([c["round"] for c in curve], [1 + c["accept_pos0"] for c in curve], marker=".",
                label="vLLM: 1 + first-position acceptance")
        ax.plot([c["round"] for c in curve], [1 + (c["trainer_accept_pos0"] or float("nan")) for c in curve],
                linestyle="--", label="trainer: 1 + first-position acceptance (train batch)")
    else:
        ax.plot([c["round"] for c in curve],
                [c["trainer_expected_acceptance_length"] or float("nan") for c in curve],
                linestyle="--", label="trainer expected acceptance length (train batch)")
    ax.axvline(args.update_at - 0.5, color="red", linewidth=1, label="policy update")
    ax.set_xlabel("rollout round")
    ax.set_ylabel("tokens per verify step")
    ax.set_title(f"online draft adaptation ({args.fixture} fixture, "
                 f"{'its own MTP layer' if args.drafter == 'mtp' else 'fresh EAGLE-3 draft'})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    print(f"[online] pre-update {pre_level}, recovered after {report['rounds_to_recover_90pct']} rounds / "
          f"{report['trainer_steps_to_recover_90pct']} trainer steps; wrote {args.out}")


if __name__ == "__main__":
    main()
