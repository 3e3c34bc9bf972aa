"""What the online draft path costs generation, by part: one server, one run, phases in turn.

Starts ``vllm serve`` as ``make demo``'s speculative run does (EAGLE-3, k = 3 with adaptive k
calibrated, ``capture_topk`` 64, the demo's dtype rule) and ``vllm-specrl train-draft --capture``
beside it exactly as the demo starts it (``vllm_specrl.rl.draft_trainer.DraftTrainerProcess``: nice 19,
SCHED_IDLE, one thread, its pause file), then sends phases of ``--concurrency`` seeded T = 1 requests of the demo's
task, ``--max-tokens`` each (``ignore_eos``: every phase generates the same number of tokens):

- ``off``: capture off (the trainer has nothing to read and idles);
- ``capture``: capture on, the trainer ingests but does not train (its pause file exists);
- ``online``: capture on and the trainer training, as during the demo's rollouts.

``--cycles`` times, the order rotating each cycle (drift cancels). Reports tokens per second per
phase and each phase's ratio to the same cycle's ``off``. Output: JSON.

    python scripts/bench/bench_online_cost.py --fixtures .fixtures --draft .fixtures/real/drafts/demo-explain
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import requests

from bench_engine import completion_wave, host_info

PHASES = ("off", "capture", "online")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=None)
    ap.add_argument("--draft", type=Path, required=True, help="EAGLE-3 draft the engine serves and the trainer trains")
    ap.add_argument("--dtype", default=None, help="default: the demo's (bf16 where the CPU multiplies it natively)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--capture-sender-cpus", default="auto", choices=["auto", "inherit"])
    ap.add_argument("--capture-sender-sched", default="auto", choices=["auto", "idle", "normal"])
    ap.add_argument("--draft-trainer-cpus", default="auto", choices=["auto", "any"], help="as in rl_demo.py")
    ap.add_argument("--draft-publish-every", type=int, default=None,
                    help="the trainer's --publish-every (default: the demo's); a huge value: the trainer never "
                         "publishes")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help="which phases each cycle runs, comma-separated (off is always one: the reference)")
    ap.add_argument("--out", type=Path, default=Path("results/bench_online_cost.json"))
    args = ap.parse_args()
    phase_names = tuple(p for p in PHASES if p in args.phases.split(",") or p == "off")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the demo
    import rl_demo
    from demo_harness import draft_trainer_settings, mean_k

    from vllm_specrl.adaptive import SCHEDULER_CLS
    from vllm_specrl.fixtures import fixture_target
    from vllm_specrl.rl.draft_trainer import DraftTrainerProcess, pause_file, trainer_cpus
    from vllm_specrl.rl.tasks import make_tasks
    from vllm_specrl.launcher import VLLMServer, free_port
    from vllm_specrl.sync.clients.engine_client import EngineClient
    from vllm_specrl.trainer.core import resolve_serving_dtype
    from vllm_specrl.trainer.offline import prompt_texts

    demo = rl_demo.build_parser().parse_args([])  # the demo's draft-trainer settings
    if args.draft_publish_every is not None:
        demo.draft_publish_every = args.draft_publish_every
    target = Path(fixture_target("real", args.fixtures))
    dtype = resolve_serving_dtype(args.dtype or "auto")
    work = args.out.parent / (args.out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)
    prompts = prompt_texts(target, [p for p, _ in make_tasks(0, args.concurrency, 0, demo.task)], chat=True)
    capture = f"tcp://127.0.0.1:{free_port()}"
    spec = {"method": "eagle3", "model": str(args.draft), "num_speculative_tokens": demo.k,
            "draft_sample_method": "probabilistic"}
    server_args = ["--dtype", dtype, "--max-model-len", "1024", "--max-num-seqs", str(args.concurrency),
                   "--speculative-config", json.dumps(spec), "--scheduler-cls", SCHEDULER_CLS,
                   "--additional-config", json.dumps({"specrl": {
                       "capture_topk": 64, "capture_sender_cpus": args.capture_sender_cpus,
                       "capture_sender_sched": args.capture_sender_sched}})]
    pause = pause_file(work, "spec")
    phases = []
    with VLLMServer(target, server_args, log_path=work / "serve.log") as srv:
        client = EngineClient(srv.url, progress=False)
        calibration = client.calibrate_adaptive_k(max_batch=args.concurrency, steps=256)
        pause.touch()
        requests.post(srv.url + "/specrl/capture", json={"enabled": True, "address": capture},
                      timeout=60).raise_for_status()  # so that the status shows where the sender runs
        trainer = DraftTrainerProcess.start(capture, srv.url, args.draft, target, work,
                                            draft_trainer_settings(demo),
                                            cpus=trainer_cpus(args.draft_trainer_cpus, client.status()))
        pause.touch()  # start() clears it; the phases below set it
        try:
            completion_wave(srv.url, srv.model, prompts[:4], 16, seeds=list(range(4)))  # warm-up
            for cycle in range(args.cycles):
                turn = cycle % len(phase_names)
                order = phase_names[turn:] + phase_names[:turn]
                for phase in order:
                    body = {"enabled": phase != "off", "address": capture}
                    requests.post(srv.url + "/specrl/capture", json=body, timeout=60).raise_for_status()
                    if phase == "online":
                        pause.unlink(missing_ok=True)
                    else:
                        pause.touch()
                    before, started_at = client.status(), time.time()
                    seeds = [1000 * cycle + i for i in range(len(prompts))]
                    tokens, wall = completion_wave(srv.url, srv.model, prompts, args.max_tokens, seeds=seeds)
                    after = client.status()
                    pause.touch()
                    time.sleep(2.0)  # the trainer finishes ingesting before the next phase
                    res = {"cycle": cycle, "phase": phase, "started_at": started_at, "tokens": sum(tokens),
                           "wall_s": wall,
                           "tokens_per_s": sum(tokens) / wall, "mean_k": mean_k(
                               before.get("adaptive_k"), after.get("adaptive_k")),
                           "capture": {k: v for k, v in (after.get("capture") or {}).items()
                                       if k.startswith(("frames_", "steps", "sender_"))} or None}
                    phases.append(res)
                    dropped = sum(v for k, v in (res["capture"] or {}).items() if k.startswith("frames_dropped"))
                    print(f"[online-cost] cycle {cycle} {phase:>7}: {res['tokens_per_s']:.1f} tok/s, "
                          f"mean k {res['mean_k']:.2f}, frames dropped {dropped}", flush=True)
            status = client.status()
        finally:
            trainer.stop(30)
    ratios = {p: [next(x["tokens_per_s"] for x in phases if x["cycle"] == c and x["phase"] == p)
                  / next(x["tokens_per_s"] for x in phases if x["cycle"] == c and x["phase"] == "off")
                  for c in range(args.cycles)] for p in phase_names[1:]}
    report = {"benchmark": "online_draft_cost", "model": str(target), "draft": str(args.draft), "host": host_info(),
              "settings": {k: str(v) for k, v in vars(args).items()} | {"dtype": dtype},
              "calibration": calibration, "phases": phases,
              "throughput_vs_off": {p: {"per_cycle": r, "mean": statistics.mean(r)} for p, r in ratios.items()},
              "engine_capture_state": status.get("capture"), "draft_trainer": status.get("draft_trainer")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print("[online-cost] throughput against capture off, same cycle: "
          + ", ".join(f"{p} {statistics.mean(r):.3f} ({' '.join(f'{x:.3f}' for x in r)})" for p, r in ratios.items())
          + f"; wrote {args.out}")


if __name__ == "__main__":
    main()
