"""Who uses the CPU during a `make demo` run: per-process CPU time, sampled every second, by phase.

``record`` samples ``/proc/<pid>/stat`` (user + system ticks, minor faults) of every process once a
second and tags each sample with the demo log's last ``[rl...]`` line; ``summarize`` splits every
RL step into its generation part (the first ``gen`` seconds after the previous step's line) and
its policy part (log-probs, update, sync), and prints the mean cores each kind of process used
(100 = one core): the vLLM worker, vLLM's engine core, the API server, the demo (policy) process
and the online draft trainer.

    python scripts/bench/trace_cpu.py record --log /tmp/demo.log --out /tmp/trace.jsonl &
    make demo > /tmp/demo.log 2>&1; kill %1
    python scripts/bench/trace_cpu.py summarize /tmp/trace.jsonl --out results/trace_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import Counter
from itertools import groupby
from pathlib import Path


def process_kind(name: str, cmdline: str) -> str:
    if "train-draft" in cmdline:
        return "draft_trainer"
    if "rl_demo" in cmdline:
        return "demo"
    if "Worker" in name:
        return "vllm_worker"
    if "EngineCor" in name or "VLLM::Eng" in name:
        return "vllm_engine_core"
    if "vllm" in cmdline and "serve" in cmdline:
        return "vllm_api_server"
    return "other"


def last_rl_line(log: Path) -> str:
    try:
        text = log.read_text(errors="ignore").replace("\r", "\n")
    except OSError:
        return ""
    lines = [ln for ln in text.splitlines() if ln.startswith("[rl")]
    return lines[-1][:120] if lines else ""


def record(log: Path, out: Path, interval: float = 1.0) -> None:
    previous: dict[str, tuple[int, int]] = {}
    first = True  # processes alive at the start count from then; later ones from their own start
    with out.open("w") as f:
        while True:
            start = time.time()
            procs = {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                    cmdline = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                except OSError:
                    continue
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                ticks, faults = int(fields[11]) + int(fields[12]), int(fields[7])
                before = previous.get(pid, None if first else (0, 0))
                if before is not None and ticks > before[0]:
                    procs[pid] = [process_kind(name, cmdline), ticks - before[0], faults - before[1]]
                previous[pid] = (ticks, faults)
            first = False
            f.write(json.dumps({"t": round(start, 2), "phase": last_rl_line(log), "procs": procs}) + "\n")
            f.flush()
            time.sleep(max(0.0, interval - (time.time() - start)))


def summarize(rows: list[dict]) -> list[dict]:
    """Per RL step (named by the log line that ends it): mean cores by process kind in its
    generation and its policy part. Samples are tagged with the line *before* them, so a step's
    samples are those tagged with the previous step's line."""
    hz = os.sysconf("SC_CLK_TCK")
    groups = [(phase, list(g)) for phase, g in groupby(rows, key=lambda r: r["phase"])]
    out = []
    for (phase, samples), (ending, _) in zip(groups, groups[1:]):
        gen = re.search(r"gen ([0-9.]+)s", ending)
        if not phase.startswith("[rl") or not gen:
            continue
        t0, gen_s = samples[0]["t"], float(gen.group(1))
        step = {"step": ":".join(ending.split(":", 2)[:2])}
        for part, chosen in (("generation", [s for s in samples if s["t"] - t0 < gen_s]),
                             ("policy", [s for s in samples if s["t"] - t0 >= gen_s])):
            ticks = Counter()
            for s in chosen:
                for kind, t, _faults in s["procs"].values():
                    ticks[kind] += t
            step[part] = {"seconds": len(chosen),
                          **{k: round(100 * v / hz / max(len(chosen), 1)) for k, v in sorted(ticks.items())}}
        out.append(step)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--log", type=Path, required=True, help="the demo's stdout, as it is written")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--interval", type=float, default=1.0)
    summ = sub.add_parser("summarize")
    summ.add_argument("trace", type=Path)
    summ.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.command == "record":
        record(args.log, args.out, args.interval)
        return
    rows = [json.loads(ln) for ln in args.trace.read_text().splitlines() if ln.strip()]
    steps = summarize(rows)
    for s in steps:
        print(s["step"][:24], "| generation:", s["generation"], "| policy:", s["policy"])
    if args.out:
        args.out.write_text(json.dumps({"cores_by_step": steps}, indent=1))


if __name__ == "__main__":
    main()
