"""benchmarks/README.md cannot cite what is not there: every JSON it names exists and records the machine it
ran on (ratios move with the CPU), and it stays the current answers (the dated record is JOURNAL.md).
No engine starts here."""

from __future__ import annotations

import json
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
README = (BENCHMARKS / "README.md").read_text()
# Written before the benchmarks recorded the CPU model (2026-11-22 / 24); their rows say so or take the
# machine from the journal.
CPU_NOT_RECORDED = {"cpu/bench_online_shift1.0.json", "cpu/bench_soak_1000.json", "cpu/bench_capture_ceiling.json",
                    "cpu/bench_sync.json"}


def expand(name: str) -> list[str]:
    """``a{,_b}{1,2}`` as a shell expands it."""
    match = re.search(r"\{([^{}]*)\}", name)
    if match is None:
        return [name]
    return [full for alt in match.group(1).split(",")
            for full in expand(name[:match.start()] + alt + name[match.end():])]


def cited_jsons(text: str) -> list[str]:
    return sorted({path for name in re.findall(r"`((?:cpu|gpu)/[^`\s]+?\.json)`", text) for path in expand(name)})


def files(cited: str) -> list[Path]:
    return sorted(BENCHMARKS.glob(cited)) if "*" in cited else [BENCHMARKS / cited]


def test_expand_reads_braces_as_a_shell_does():
    assert expand("cpu/x{,_b}{1,2}.json") == ["cpu/x1.json", "cpu/x2.json", "cpu/x_b1.json", "cpu/x_b2.json"]
    assert cited_jsons("see `cpu/a{_s2,_s4}.json` and `gpu/b.json`") == ["cpu/a_s2.json", "cpu/a_s4.json", "gpu/b.json"]


def test_every_cited_json_exists():
    cited = cited_jsons(README)
    assert len(cited) >= 40
    found = {c: files(c) for c in cited}
    assert [c for c, paths in found.items() if not paths or not all(p.is_file() for p in paths)] == []


def records_machine(report: object) -> bool:
    """A report names its processor: ``host.cpu_model`` (``vllm_specrl.host.host_info``), ``host.device``
    (the GPU reading), ``cpu_model`` (first-run timings), or a list of reports that each do (runs appended)."""
    if isinstance(report, list):
        return bool(report) and all(records_machine(entry) for entry in report)
    if not isinstance(report, dict):
        return False
    host = report.get("host") if isinstance(report.get("host"), dict) else {}
    return bool(host.get("cpu_model") or host.get("device") or report.get("cpu_model"))


def test_records_machine_needs_a_named_processor_in_every_entry():
    assert records_machine([{"host": {"cpu_model": "x"}}, {"cpu_model": "y"}, {"host": {"device": "H200"}}])
    assert not records_machine([{"host": {"cpu_model": "x"}}, {"date": "z"}]) and not records_machine([])
    assert not records_machine({"host": {"platform": "Linux", "cpus": 2}})


def test_every_cited_json_records_its_machine():
    unrecorded = [c for c in cited_jsons(README) if c not in CPU_NOT_RECORDED
                  for p in files(c) if not records_machine(json.loads(p.read_text()))]
    assert unrecorded == []


def test_it_stays_the_current_answers():
    """A page of answers, each a table, not a notebook of runs by date (that is JOURNAL.md)."""
    assert len(README.splitlines()) <= 300
    sections = re.split(r"^## ", README, flags=re.M)[1:]
    assert len(sections) >= 6
    without_table = [s.splitlines()[0] for s in sections if "\n|---" not in s and not s.startswith("GPU")]
    assert without_table == []
    assert (BENCHMARKS / "JOURNAL.md").is_file() and "(JOURNAL.md)" in README
