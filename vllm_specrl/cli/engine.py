"""``vllm-specrl status``, ``calibrate``, ``doctor`` and ``selftest``: a served engine, and this machine's vLLM."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def run_status(args: argparse.Namespace) -> int:
    import requests

    from vllm_specrl.sync.clients.response_check import SpecRLRoutesMissing, raise_if_missing

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    resp = requests.get(args.engine.rstrip("/") + "/specrl/status", headers=headers, timeout=30)
    try:
        raise_if_missing(resp)
    except SpecRLRoutesMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        print(f"error: HTTP {resp.status_code}: {resp.text}", file=sys.stderr)
        return 1
    print(json.dumps(resp.json(), indent=2))
    return 0


def run_doctor(args: argparse.Namespace) -> int:
    from vllm_specrl.doctor import diagnose, format_report

    found = diagnose()
    print(json.dumps(found, indent=2) if args.json else format_report(found))
    return 0 if found["ok"] else 1


def run_selftest(args: argparse.Namespace) -> int:
    from vllm_specrl.selftest.run import GROUPS, Settings, as_json, default_model, format_table, selftest

    groups = tuple(g.strip() for g in args.only.split(",")) if args.only else GROUPS
    unknown = set(groups) - set(GROUPS)
    if unknown:
        print(f"error: unknown check groups {sorted(unknown)}; choose from {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    settings = Settings(model=args.model or default_model(), samples=args.samples, groups=groups)
    started = time.perf_counter()
    checks = selftest(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(checks))
    if args.json:
        found = as_json(checks, settings, round(time.perf_counter() - started, 1))
        args.json.write_text(json.dumps(found, indent=1) + "\n")
    return 0 if all(c.passed for c in checks) else 1


def run_calibrate(args: argparse.Namespace) -> int:
    from vllm_specrl.adaptive.k_sweep import calibrate

    report = calibrate(args.engine, max_batch=args.max_batch, steps=args.steps, api_key=args.api_key)
    print(json.dumps(report, indent=2))
    if not report["adaptive_k"]:
        print("note: this engine serves no adaptive k (--scheduler-cls vllm_specrl.adaptive.scheduler."
              "AdaptiveKScheduler): it was only warmed up", file=sys.stderr)
    return 0



def add_commands(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("status", help="print /specrl/status of a running vllm serve")
    st.add_argument("--engine", default="http://127.0.0.1:8000")
    st.add_argument("--api-key", default=None)
    st.set_defaults(func=run_status)

    ca = sub.add_parser("calibrate", help="measure what a step of every k costs at every batch size up to "
                                          "--max-batch, before serving rollouts (adaptive k)")
    ca.add_argument("--engine", default="http://127.0.0.1:8000")
    ca.add_argument("--api-key", default=None)
    ca.add_argument("--max-batch", type=int, default=16, help="the largest batch the rollouts run at")
    ca.add_argument("--steps", type=int, default=256,
                    help="most tokens per calibration request (each is dropped once its bucket is measured)")
    ca.set_defaults(func=run_calibrate)

    dr = sub.add_parser("doctor", help="list every engine patch and what it does on this machine's vLLM "
                                       "(installed, skipped and why, failed), and check vLLM's internals it uses")
    dr.add_argument("--json", action="store_true", help="the findings as JSON")
    dr.set_defaults(func=run_doctor)

    se = sub.add_parser("selftest", help="check losslessness (greedy and T=1, EAGLE-3 and history against plain "
                                         "vLLM), weight updates, capture and status on this machine's vLLM")
    se.add_argument("--model", type=Path, default=None,
                    help="an HF model directory (Llama/Qwen2/Qwen3 for the EAGLE-3 checks); default: the "
                         "package's tiny fixture, built once into ~/.cache/vllm-specrl/fixtures")
    se.add_argument("--samples", type=int, default=3000, help="samples per engine for the T=1 tests")
    from vllm_specrl.selftest.run import GROUPS

    se.add_argument("--only", default=None, help=f"comma-separated groups: {','.join(GROUPS)}")
    se.add_argument("--json", type=Path, default=None, help="also write the results here")
    se.set_defaults(func=run_selftest)
