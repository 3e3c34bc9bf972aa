"""``scripts/demo_plan.py`` and ``scripts/first_run_phases.py``: the first-run estimate `make demo` prints
up front comes from the measured run nearest this CPU, leaves out what is already done here, and the
phases are cut where the log says each one ended."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import demo_plan  # noqa: E402
import first_run_phases  # noqa: E402

RUNS = [{"isa_kind": "avx2", "cpus": 2, "cpu_model": "AMD EPYC", "date": "2026-11-29",
         "phases_s": {"setup": 240, "fixture": 30, "draft": 300, "demo": 900}},
        {"isa_kind": "amx", "cpus": 2, "cpu_model": "Intel Xeon", "date": "2026-11-29",
         "phases_s": {"setup": 200, "fixture": 20, "draft": 120, "demo": 300}}]


def test_the_nearest_measured_cpu_kind_is_used():
    assert [r["cpu_model"] for r in demo_plan.nearest_runs(RUNS, "avx2", 2)] == ["AMD EPYC"]
    assert [r["cpu_model"] for r in demo_plan.nearest_runs(RUNS, "amx", 2)] == ["Intel Xeon"]
    assert [r["isa_kind"] for r in demo_plan.nearest_runs(RUNS, "avx512", 8)] == ["avx2"]  # one rank from either
    assert demo_plan.nearest_runs([], "avx2", 2) == []


def test_the_plan_adds_only_what_is_left_to_do():
    lines = demo_plan.plan(RUNS, "avx2", 2, done=set())
    assert "like this one" in lines[0] and lines[-1].endswith("about 24 min in all from here")
    lines = demo_plan.plan(RUNS, "avx2", 2, done={"setup", "fixture", "draft"})
    assert sum("done already" in line for line in lines) == 3 and lines[-1].endswith("about 15 min in all from here")
    assert "nearest measured" in demo_plan.plan(RUNS, "avx512", 2, done=set())[0]


def test_several_runs_of_the_kind_give_each_phase_its_range():
    slower = {"isa_kind": "avx2", "cpus": 2, "cpu_model": "AMD EPYC", "date": "2026-12-01",
              "phases_s": {"setup": 240, "fixture": 30, "draft": 540, "demo": 1200}}
    lines = demo_plan.plan(RUNS + [slower], "avx2", 2, done=set())
    assert "2026-11-29, 2026-12-01" in lines[0] and "range" in lines[0]
    draft = next(line for line in lines if "draft " in line)
    assert "5.0-9.0 min" in draft
    assert next(line for line in lines if "setup " in line).split()[2] == "4.0"   # equal: one figure
    assert lines[-1].endswith("about 24-34 min in all from here")
    # The Intel run is not of the kind: it stays out of the range.
    assert all("Intel" not in line for line in lines)
    # Runs of one kind on other CPUs: the header names each, not only the first.
    other = {**slower, "cpu_model": "Intel Xeon", "date": "2026-12-02"}
    header = demo_plan.plan(RUNS + [slower, other], "avx2", 2, done=set())[0]
    assert "AMD EPYC / Intel Xeon" in header and "2026-12-02" in header


def test_the_phases_end_where_the_log_says():
    log = ["07:00:00 [setup] creating .venv", "07:04:00 [setup] ok: vllm 0.32.0", "07:04:30 real: converted",
           "07:05:00 [draft] building x", "07:10:00 warm start 100%", "07:10:30 [rl] starting the spec run",
           "07:25:30 wrote results/rl_demo.json"]
    assert first_run_phases.phases(log) == {"setup": 240, "fixture": 60, "draft": 330, "demo": 900, "total": 1530}
    cached = [line for line in log if "[draft]" not in line]
    assert first_run_phases.phases(cached)["draft"] == 0
    over_midnight = ["23:59:00 [setup] ok", "23:59:30 [rl] go", "00:01:00 end"]
    assert first_run_phases.phases(over_midnight)["demo"] == 90


def test_with_the_clone_the_phases_end_when_each_phase_wrote_its_files(tmp_path):
    import os
    import time

    day = time.mktime(time.strptime("2026-11-29 07:00:00", "%Y-%m-%d %H:%M:%S"))
    for rel, at in ((".venv/.specrl-setup", 120), (".fixtures/real/target/config.json", 150),
                    (".fixtures/real/drafts/quick/make_args", 500)):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
        os.utime(path, (day + at, day + at))
    log = ["07:00:00 [demo] plan", "07:03:00 [setup] ok (printed late: buffered)", "07:20:00 wrote"]
    assert first_run_phases.phases_from_files(log, tmp_path) == {"setup": 120, "fixture": 30, "draft": 350,
                                                                 "demo": 700, "total": 1200}
