"""Split a first `make demo` into its phases (what scripts/demo_plan.py reads).

The log's lines start with the time they were printed (``HH:MM:SS``, as ``scripts/time_first_run.sh``
stamps them): its first and last lines are the run's start and end. Phase ends, with ``--clone``: the
files each phase leaves (the venv's setup stamp, the fixture's config, the draft's ``make_args``), whose
times do not depend on how a tool buffered its output; without it, log markers (``[setup] ok``, the draft
build's first line, the demo's first ``[rl]`` line), which buffered output can delay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_plan import isa_kind  # noqa: E402


def phases(lines: list[str]) -> dict[str, float]:
    """Seconds per phase from ``HH:MM:SS text`` lines (a run may pass midnight once)."""
    stamped, day = [], 0
    for line in lines:
        clock, _, text = line.partition(" ")
        try:
            h, m, s = (int(x) for x in clock.split(":"))
        except ValueError:
            continue
        t = h * 3600 + m * 60 + s + day
        if stamped and t < stamped[-1][0]:
            day += 86400
            t += 86400
        stamped.append((t, text))

    def first(pred) -> float:
        return next(t for t, text in stamped if pred(text))

    start, end = stamped[0][0], stamped[-1][0]
    setup = first(lambda x: x.startswith("[setup] ok"))
    demo_start = first(lambda x: x.startswith("[rl]"))
    draft_start = next((t for t, x in stamped if x.startswith("[draft] building")), demo_start)
    return {"setup": setup - start, "fixture": draft_start - setup, "draft": demo_start - draft_start,
            "demo": end - demo_start, "total": end - start}


def phases_from_files(lines: list[str], clone: Path) -> dict[str, float]:
    """Seconds per phase from the files each phase leaves in ``clone`` (same day as the log)."""
    def clock(text: str) -> int:
        h, m, sec = (int(x) for x in text.split(":"))
        return h * 3600 + m * 60 + sec

    def mtime(path: Path) -> int:
        t = time.localtime(path.stat().st_mtime)
        return t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec

    stamps = [line.partition(" ")[0] for line in lines if line[:2].isdigit() and line[2:3] == ":"]
    start, end = clock(stamps[0]), clock(stamps[-1])
    setup = mtime(clone / ".venv" / ".specrl-setup")
    fixture = mtime(clone / ".fixtures" / "real" / "target" / "config.json")
    drafts = sorted((clone / ".fixtures" / "real" / "drafts").glob("*/make_args"), key=lambda q: q.stat().st_mtime)
    draft = mtime(drafts[-1]) if drafts else fixture
    return {"setup": setup - start, "fixture": fixture - setup, "draft": draft - fixture, "demo": end - draft,
            "total": end - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--results", type=Path, default=None, help="the demo's JSON report (its summary is kept)")
    ap.add_argument("--make-args", default="", help="what `make demo` was given")
    ap.add_argument("--clone", type=Path, default=None, help="the clone it ran in: phase ends from its files")
    args = ap.parse_args()
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "unknown")
    lines = args.log.read_text(errors="replace").splitlines()
    record = {"date": time.strftime("%Y-%m-%d"), "cpu_model": cpu_model, "isa_kind": isa_kind(),
              "cpus": os.cpu_count(), "make_args": args.make_args,
              "phases_s": phases_from_files(lines, args.clone) if args.clone else phases(lines)}
    if args.results and args.results.exists():
        report = json.loads(args.results.read_text())
        record["demo_summary"] = report.get("summary")
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["phases_s"]))


if __name__ == "__main__":
    main()
