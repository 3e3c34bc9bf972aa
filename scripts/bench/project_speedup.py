"""Project end-to-end RL step speedup from stage times and speculative rollout figures.

Formulas: ``scripts/bench/projection.py``. Inputs either measured (``--from-json``
with an RL demo's per-step records: generation_s, training_s, logprob_s,
sync_s) or given (``--rollout-share``). The rollout speedup is either given
(``--rollout-speedup``) or built from acceptance length and step cost
(``--acceptance-length`` with ``--step-cost``, or with ``--k`` and
``--draft-cost`` [``--verify-extra``]). ``--check-paper`` reproduces the
published anchor: NeMo RL (arXiv:2604.26779) reports 1.77x rollout speedup at
8B with a rollout share of 65-72%.

    python scripts/bench/project_speedup.py --rollout-share 0.7 --acceptance-length 2.6 --k 3 --draft-cost 0.05
    python scripts/bench/project_speedup.py --check-paper
    python scripts/bench/project_speedup.py --check-demo results/rl_demo.json [--spec-run spec-async]

``--acceptance-needed`` inverts the model for a ``bench_step_cost.py`` JSON: for each fixed-k cell, its
step cost in plain steps (median over rounds) and the per-draft acceptance a draft needs there to break
even and to reach ``--time-ratio`` (generation time against plain, e.g. 0.8):

    python scripts/bench/project_speedup.py --acceptance-needed benchmarks/cpu/bench_step_cost_demo_bf16_amd512.json

``--from-json`` takes an ``rl_demo.py`` report (``--run`` picks whose stage
times, default plain) or a bare ``{"steps": [...]}``. ``--check-demo`` sets the
step speedup projected from the plain run's stage times and the rollout
speedup measured in the same demo beside the measured one: the gap is what the
model leaves out (on a shared CPU, speculation slows the other stages too).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from projection import StageTimes, acceptance_needed, project, rollout_speedup, step_cost  # noqa: E402

PAPER = {"rollout_speedup": 1.77, "rollout_share": (0.65, 0.72), "reported_step_speedup": "about 1.4x"}


def run_steps(data: dict, run: str) -> list[dict]:
    """Per-step records: a bare ``{"steps": [...]}`` or one run of an ``rl_demo.py`` report."""
    if "runs" in data:
        if run not in data["runs"]:
            raise SystemExit(f"run {run!r} not in the report (has {sorted(data['runs'])})")
        return data["runs"][run]["steps"]
    return data["steps"]


def stage_times_from_steps(steps: list[dict]) -> StageTimes:
    med = lambda key: statistics.median(s.get(key, 0.0) for s in steps)  # noqa: E731
    return StageTimes(med("generation_s"), med("training_s") + med("logprob_s") + med("sync_s"))


def stage_times_from_json(path: Path, run: str = "plain") -> StageTimes:
    return stage_times_from_steps(run_steps(json.loads(path.read_text()), run))


def check_against_demo(path: Path, spec_run: str) -> dict:
    """Project the step ratio from the plain run's stage times and the rollout ratio measured in the same
    demo, and set it beside the measured step ratio: what the model explains, and what it does not."""
    data = json.loads(path.read_text())
    plain_steps, spec_steps = run_steps(data, "plain"), run_steps(data, spec_run)
    plain, spec = stage_times_from_steps(plain_steps), stage_times_from_steps(spec_steps)
    speedup = plain.rollout_s / spec.rollout_s
    row = project(plain, speedup)
    key = "async_spec_vs_sync_plain" if spec_run.endswith("-async") else "sync_step_speedup"
    wall = lambda steps: statistics.median(s["step_s"] for s in steps)  # noqa: E731
    out = {"demo": str(path), "spec_run": spec_run, "measured_rollout_speedup": speedup,
           "projected_step_speedup": row[key], "projection": key,
           "measured_step_speedup": wall(plain_steps) / wall(spec_steps),
           "measured_other_stages_ratio": spec.other_s / plain.other_s}
    print(f"{spec_run} vs plain (medians): rollout speedup {speedup:.2f}x -> projected step speedup "
          f"{out['projected_step_speedup']:.2f}x, measured {out['measured_step_speedup']:.2f}x; the non-rollout "
          f"stages took {out['measured_other_stages_ratio']:.2f}x as long with speculation on (shared cores), "
          "which the model does not include")
    return out


def needed_from_step_costs(path: Path, time_ratio: float) -> dict:
    """Per fixed-k cell of a ``bench_step_cost.py`` report (``eagle3_k{K}_{sampling}`` rows against plain
    in the same round): the median step cost and the per-draft acceptance that breaks even and that
    reaches ``time_ratio`` of plain's generation time (None: not even with every draft accepted)."""
    data = json.loads(path.read_text())
    costs: dict[tuple[str, int, int], list[float]] = {}
    for row in data["rows"]:
        match = re.fullmatch(r"eagle3_k(\d+)_([a-z]+)(#\d+)?", row.get("name", ""))
        if match and "step_cost_vs_plain" in row:
            key = (match.group(2), int(match.group(1)), row["batch_size"])
            costs.setdefault(key, []).append(row["step_cost_vs_plain"])
    cells = []
    for (sampling, k, batch), values in sorted(costs.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        cost = statistics.median(values)
        cells.append({"batch_size": batch, "k": k, "sampling": sampling, "rounds": len(values),
                      "step_cost": cost, "step_cost_range": [min(values), max(values)],
                      "acceptance_to_break_even": acceptance_needed(cost, k),
                      f"acceptance_for_{time_ratio:g}": acceptance_needed(cost, k, 1 / time_ratio)})
    fmt = lambda a: "unreachable" if a is None else f"{a:.2f}"  # noqa: E731
    print(f"| sequences | k | sampling | step cost (plain steps) | acceptance to break even | "
          f"acceptance for {time_ratio:g} |")
    print("|---|---|---|---|---|---|")
    for c in cells:
        lo, hi = c["step_cost_range"]
        print(f"| {c['batch_size']} | {c['k']} | {c['sampling']} | {c['step_cost']:.2f} ({lo:.2f}-{hi:.2f}) | "
              f"{fmt(c['acceptance_to_break_even'])} | {fmt(c[f'acceptance_for_{time_ratio:g}'])} |")
    return {"step_costs": str(path), "host": data.get("host"), "time_ratio": time_ratio, "cells": cells}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollout-share", type=float)
    ap.add_argument("--from-json", type=Path)
    ap.add_argument("--rollout-speedup", type=float)
    ap.add_argument("--acceptance-length", type=float)
    ap.add_argument("--step-cost", type=float)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-cost", type=float)
    ap.add_argument("--verify-extra", type=float, default=0.0)
    ap.add_argument("--draft-overhead-share", type=float, default=0.0)
    ap.add_argument("--run", default="plain", help="with --from-json on an rl_demo report: whose stage times")
    ap.add_argument("--check-demo", type=Path, help="an rl_demo report: projected vs measured step ratio")
    ap.add_argument("--spec-run", default="spec", help="with --check-demo: the speculative run to compare")
    ap.add_argument("--check-paper", action="store_true")
    ap.add_argument("--acceptance-needed", type=Path, metavar="STEP_COST_JSON",
                    help="a bench_step_cost.py report: the acceptance each cell needs (see above)")
    ap.add_argument("--time-ratio", type=float, default=0.8,
                    help="with --acceptance-needed: the generation time against plain to reach")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    if args.acceptance_needed:
        report = needed_from_step_costs(args.acceptance_needed, args.time_ratio)
    elif args.check_demo:
        report = check_against_demo(args.check_demo, args.spec_run)
    elif args.check_paper:
        rows = [project(StageTimes.from_share(share), PAPER["rollout_speedup"])
                for share in PAPER["rollout_share"]]
        report = {"paper": PAPER, "projections": rows,
                  "sync_step_speedup_range": [r["sync_step_speedup"] for r in rows]}
        lo, hi = report["sync_step_speedup_range"]
        print(f"paper anchor: rollout 1.77x at rollout share 65-72% -> projected step speedup "
              f"{lo:.2f}x-{hi:.2f}x (synchronous); paper: {PAPER['reported_step_speedup']}")
    else:
        if args.from_json:
            times = stage_times_from_json(args.from_json, args.run)
        elif args.rollout_share is not None:
            times = StageTimes.from_share(args.rollout_share, args.draft_overhead_share)
        else:
            ap.error("give --rollout-share or --from-json (or --check-paper)")
        if args.rollout_speedup is not None:
            s = args.rollout_speedup
        elif args.acceptance_length is not None:
            cost = args.step_cost if args.step_cost is not None else (
                step_cost(args.k, args.draft_cost, args.verify_extra) if args.draft_cost is not None else None)
            if cost is None:
                ap.error("with --acceptance-length give --step-cost or --draft-cost")
            s = rollout_speedup(args.acceptance_length, cost)
        else:
            ap.error("give --rollout-speedup or --acceptance-length")
        report = project(times, s)
        for key, value in report.items():
            if key != "inputs":
                print(f"{key:28s} {value:.3f}x")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
