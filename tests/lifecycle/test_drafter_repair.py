"""The drafter survives what an RL job does to an engine (``vllm_specrl.lifecycle``), on real engines.

The tiny target serves the warm EAGLE-3 draft (float32, greedy, k = 3, the same eight prompts each
time, so a drafter as it was serves exactly the acceptance it served before). Each engine plays a
sequence (``drafter_job.py``):

- ``repair`` (the default), checked every step: the drafter zeroed through a user's ``collective_rpc``
  is repaired after that call, before the next step drafts; zeroed directly (no event) it is repaired by
  the periodic check; a policy update aimed at every runner (miles #1926's shape) loads the target and
  is refused at the drafter. After each, the served acceptance equals the first, the tokens are the
  same, and the repair is counted with its cause in the workers' watch and the engine core's state. A
  wake-up that leaves the drafter discarded (vLLM #52479; the CPU has no sleep mode, so the executor's
  wake-up is replaced by that discard inside vLLM's own ``EngineCore.wake_up``) is repaired before serving
  resumes.
- ``report``, no periodic check, a short collapse window: the drafter zeroed through an RPC is reported
  and collapses the acceptance; ``draft_collapsed`` is raised naming that call, nothing repaired; a draft update
  brings acceptance back and the alarm clears. The draft's config says 64 positions against the
  engine's 512: the load check warns with the numbers.
- ``refuse``: the drafter zeroed through an RPC stops drafting (no drafts at all, the same tokens)
  until a draft update arrives; then drafting resumes at the first acceptance.

What would fail: a repair that does not restore the exact weights (acceptance differs), a repair after
the next step rather than before (acceptance of the step after the RPC falls), an uncounted repair, a
draft loaded from a policy update, a collapse not raised or raised without its event, a refusal that
drafts anyway or never ends.

Engines: three in-process engines (one per ``on_damage`` mode: the mode is engine configuration), each
~40 s on the tiny model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import run_function
from prompts import code_prompts

pytestmark = pytest.mark.server


def play(target: Path, draft: Path, drafter: dict, steps: list[str]) -> dict:
    import drafter_job

    config = {"target": str(target), "draft": str(draft), "drafter": drafter, "steps": steps,
              "prompts": code_prompts(8)}
    return run_function(drafter_job.run, config, env={"VLLM_PLUGINS": "specrl"}, timeout=900)


def steps_of(report: dict, name: str) -> list[dict]:
    return [s for s in report["steps"] if s["step"] == name]


@pytest.fixture(scope="module")
def repair_run(tiny_model, warm_draft) -> dict:
    return play(tiny_model, warm_draft, {"on_damage": "repair", "check_every_s": 0},
                ["generate", "damage_rpc", "generate", "damage_direct", "generate", "policy_to_every_runner",
                 "generate", "wake_after_discard", "generate"])


def test_a_drafter_overwritten_through_an_rpc_is_repaired_before_the_next_step(repair_run):
    first, after_rpc = steps_of(repair_run, "generate")[:2]
    assert first["served"]["acceptance_length"] > 1.5, first["served"]  # the draft drafts: repair is visible
    assert after_rpc["served"] == first["served"] and after_rpc["tokens"] == first["tokens"]
    damaged = steps_of(repair_run, "damage_rpc")[0]
    assert damaged["watch"]["repairs"] == {"collective_rpc": 1}, damaged["watch"]
    assert damaged["watch"]["last_repair"]["repaired"] and damaged["watch"]["draft_mismatch"] is None
    assert damaged["drafter"]["repairs"] == {"collective_rpc": 1}


def test_a_drafter_damaged_with_no_event_is_repaired_by_the_periodic_check(repair_run):
    first, after_direct = steps_of(repair_run, "generate")[0], steps_of(repair_run, "generate")[2]
    assert after_direct["served"]["acceptance_length"] == pytest.approx(first["served"]["acceptance_length"], abs=0.05)
    assert after_direct["tokens"] == first["tokens"]
    assert after_direct["drafter"]["repairs"].get("periodic check") == 1, after_direct["drafter"]


def test_a_policy_update_aimed_at_every_runner_never_reaches_the_drafter(repair_run):
    update = steps_of(repair_run, "policy_to_every_runner")[0]
    assert update["outcome"]["target"] == "loaded"
    draft_outcome = update["outcome"]["draft"]
    assert draft_outcome.startswith("refused") and "unknown parameter name" in draft_outcome, update
    assert update["versions"]["policy"] == 1 and update["versions"]["draft"] == 0
    first, after = steps_of(repair_run, "generate")[0], steps_of(repair_run, "generate")[3]
    assert after["served"] == first["served"] and after["tokens"] == first["tokens"]
    assert after["drafter"]["repairs"] == {"collective_rpc": 1, "periodic check": 1}  # the refused load: nothing


def test_a_wake_up_that_leaves_the_drafter_discarded_is_repaired_before_serving_resumes(repair_run):
    first, after_wake = steps_of(repair_run, "generate")[0], steps_of(repair_run, "generate")[-1]
    woken = steps_of(repair_run, "wake_after_discard")[0]
    assert woken["drafter"]["repairs"].get("wake_up") == 1, woken["drafter"]
    assert after_wake["served"] == first["served"] and after_wake["tokens"] == first["tokens"]


@pytest.fixture(scope="module")
def report_run(tiny_model, warm_draft, tmp_path_factory) -> dict:
    short = tmp_path_factory.mktemp("short-range") / "draft"
    shutil.copytree(warm_draft, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(config))
    return play(tiny_model, short, {"on_damage": "report", "check_every_s": -1, "collapse_window": 16},
                ["generate", "damage_rpc", "generate", "draft_update", "generate", "generate"])


def test_the_collapse_alarm_names_the_event_and_clears_when_acceptance_returns(report_run):
    first, collapsed, after_update, later = steps_of(report_run, "generate")
    assert collapsed["served"]["acceptance_length"] < 1.05 < first["served"]["acceptance_length"]
    alarm = collapsed["drafter"]["collapse"]
    assert alarm["active"] and not alarm["repair_tried"], alarm
    assert alarm["length_before"] >= alarm["length"] + 0.25
    assert alarm["after_event"]["event"] == "collective_rpc(_damage)", alarm
    assert collapsed["drafter"]["repairs"] == {}  # report mode: nothing restored
    assert collapsed["watch"]["draft_mismatch"]["after"] == "collective_rpc(_damage)"
    assert collapsed["tokens"] == first["tokens"]  # lossless throughout
    assert later["served"]["acceptance_length"] == pytest.approx(first["served"]["acceptance_length"], abs=0.05)
    assert not later["drafter"]["collapse"]["active"] and later["drafter"]["collapse"]["recovered"]


def test_a_draft_configured_for_fewer_positions_than_served_is_warned_at_load(report_run):
    checks = report_run["steps"][0]["watch"]["load_checks"]
    assert checks["errors"] == [] and checks["max_model_len"] == 512
    assert any("64 positions" in w and "512" in w for w in checks["warnings"]), checks


@pytest.fixture(scope="module")
def refuse_run(tiny_model, warm_draft) -> dict:
    return play(tiny_model, warm_draft, {"on_damage": "refuse", "check_every_s": -1},
                ["generate", "damage_rpc", "generate", "draft_update", "generate"])


def test_refuse_stops_drafting_until_a_draft_update_arrives(refuse_run):
    first, refused, resumed = steps_of(refuse_run, "generate")
    damaged = steps_of(refuse_run, "damage_rpc")[0]
    assert damaged["drafter"]["refusing"] is not None and damaged["watch"]["refusing"] is not None
    assert refused["served"]["num_drafts"] == 0 and refused["tokens"] == first["tokens"]
    update = steps_of(refuse_run, "draft_update")[0]
    assert update["drafter"]["refusing"] is None and update["versions"]["draft"] == 1
    assert resumed["served"]["acceptance_length"] == pytest.approx(first["served"]["acceptance_length"], abs=0.05)
