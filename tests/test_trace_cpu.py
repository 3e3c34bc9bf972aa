"""``scripts/bench/trace_cpu.py``: a step's samples split into generation and policy at the step's own
``gen`` seconds, and a live recording counts a process's CPU time as the process itself does.

Engines: the trace recorder and a busy process to record: CPU time is counted across processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from trace_cpu import summarize  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


def _rows(phase: str, start: float, seconds: int, gen: int) -> list[dict]:
    """One sample a second: the worker busy during generation, the demo on two cores after it."""
    return [{"t": start + i, "phase": phase,
             "procs": {"1": ["vllm_worker", HZ, 0]} if i < gen else {"2": ["demo", 2 * HZ, 0]}}
            for i in range(seconds)]


def test_a_step_splits_at_its_generation_seconds() -> None:
    """A step's samples are those logged after the previous step's line (the line a step prints
    comes at its end)."""
    rows = (_rows("[rl:spec] warm-up step -1: gen 5.0s", 0, 10, 4)   # step 0: gen 4 s
            + _rows("[rl:spec] step 0: reward 0.2, gen 4.0s (bulk 3.0s)", 10, 10, 6)  # step 1: gen 6 s
            + _rows("[rl:spec] step 1: reward 0.1, gen 6.0s (bulk 5.0s)", 20, 3, 0))  # nothing ends it
    steps = summarize(rows)
    assert [s["step"] for s in steps] == ["[rl:spec] step 0", "[rl:spec] step 1"]
    assert steps[0]["generation"] == {"seconds": 4, "vllm_worker": 100}
    assert steps[0]["policy"] == {"seconds": 6, "demo": 200}
    assert steps[1]["generation"] == {"seconds": 6, "vllm_worker": 100}
    assert steps[1]["policy"] == {"seconds": 4, "demo": 200}


def test_recording_counts_a_process_cpu_time(tmp_path) -> None:
    """The recorded ticks of a process started while recording add up to the CPU time it reports
    itself, from its start (a pid first seen late still counts from zero). It stays alive, idle,
    until a sample after its busy spell is written: a sampler cannot see what a process uses
    between its last sample and its exit."""
    log, out = tmp_path / "demo.log", tmp_path / "trace.jsonl"
    log.write_text("[rl:spec] warm-up step -1: gen 1.0s\n")
    rec = subprocess.Popen([sys.executable, str(REPO / "scripts" / "bench" / "trace_cpu.py"), "record", "--log",
                            str(log),
                            "--out", str(out), "--interval", "0.25"])
    busy = None
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (out.exists() and out.read_text().strip()):
            time.sleep(0.05)  # the recorder's first sweep is done: the process below is new to it
        busy = subprocess.Popen([sys.executable, "-c", "import sys, time\nt = time.time()\n"
                                 "while time.time() - t < 2: pass\n"
                                 "print(time.process_time(), flush=True)\nsys.stdin.read()", "train-draft"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        reported = float(busy.stdout.readline())
        done = time.time()
        deadline = done + 60
        while time.time() < deadline and not any(json.loads(ln)["t"] > done + 0.05
                                                 for ln in out.read_text().splitlines() if ln.strip()):
            time.sleep(0.1)
        busy.stdin.close()
        busy.wait(timeout=30)
    finally:
        rec.kill()
        if busy is not None:
            busy.kill()
    rows = [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()]
    assert rows and all(r["phase"] == "[rl:spec] warm-up step -1: gen 1.0s" for r in rows)
    seen = sum(t for r in rows for kind, t, _ in r["procs"].values() if kind == "draft_trainer") / HZ
    assert reported - 0.05 <= seen <= reported + 0.05, (seen, reported)
