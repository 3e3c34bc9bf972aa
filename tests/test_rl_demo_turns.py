"""``demo_harness.run_interleaved`` (the RL demo's harness): the order in which the parent starts the runs'
processes, times their steps and finishes them (a stand-in for each run's process; the real processes
are driven end to end by tests/test_rl_demo_mtp.py), and the demo's own checks of its options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import load_script

REPO = Path(__file__).resolve().parents[1]


def _harness_module():
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    return load_script("scripts/demo_harness.py")


def _rl_demo_module():
    return load_script("scripts/rl_demo.py")


def test_runs_start_one_by_one_step_in_rotating_turns_and_proposers_finish_first(tmp_path, monkeypatch):
    harness = _harness_module()
    events = []

    class FakeRun:
        def __init__(self, script, cfg, env, log_path, timeout_s, args=()):
            assert cfg is None and log_path is None and args[-1] == "--_take-turns"
            self.mode = args[args.index("--runs") + 1]
            assert args[args.index("--out") + 1] == str(tmp_path / f"run_{self.mode}.json")
            events.append(("start", self.mode))

        def request(self, command):
            events.append((self.mode, command))
            if "finish" in command:
                run = {"steps": [], "replayed": command["finish"]["replay_of"]}
                (tmp_path / f"run_{self.mode}.json").write_text(json.dumps({"runs": {self.mode: run}}))
                return {"out": "written"}
            return {"step": command["step"] - 1}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append(("closed", self.mode))

    monkeypatch.setattr(harness, "EngineProcess", FakeRun)
    monkeypatch.setattr("sys.argv", ["rl_demo.py", "--steps", "3"])
    finished = {}
    harness.run_interleaved("rl_demo.py", ["plain", "spec"], 4, Path("/target"), tmp_path,
                            lambda m: [r for r in finished if r.startswith("spec")] if m == "plain" else [],
                            lambda m, run: finished.__setitem__(m, run))
    steps = [(m, c["step"]) for m, c in events if isinstance(c, dict) and "step" in c]
    assert events[:2] == [("start", "plain"), ("start", "spec")]
    assert steps == [("plain", 0), ("spec", 0), ("spec", 1), ("plain", 1), ("plain", 2), ("spec", 2),
                     ("spec", 3), ("plain", 3)]
    finishes = [(m, c["finish"]["replay_of"]) for m, c in events if isinstance(c, dict) and "finish" in c]
    assert finishes == [("spec", []), ("plain", ["spec"])]  # plain replays spec's lengths
    assert list(finished) == ["spec", "plain"] and finished["plain"]["replayed"] == ["spec"]
    assert {e for e in events if e[0] == "closed"} == {("closed", "plain"), ("closed", "spec")}


def test_a_run_reads_its_turns_and_a_quit_ends_it_cleanly():
    """In a run's process: the step index or finish body the parent sent; a quit (the parent stopping the
    runs after another failed) exits through the run's cleanup; any other command is an error."""
    demo = _rl_demo_module()

    class Turns:
        def __init__(self, *commands):
            self.commands = list(commands)

        def next(self):
            return self.commands.pop(0)

    assert demo.next_turn(Turns({"step": 3}), "spec", "step") == 3
    assert demo.next_turn(Turns({"finish": {"replay_of": ["spec"]}}), "plain", "finish") == {"replay_of": ["spec"]}
    with pytest.raises(SystemExit, match="stopped by the parent"):
        demo.next_turn(Turns({"quit": True}), "spec", "step")
    with pytest.raises(RuntimeError, match="expected a finish command"):
        demo.next_turn(Turns({"step": 4}), "spec", "finish")


def test_history_config_is_checked_before_any_engine_starts(capsys):
    """``--history-config`` reaches the history runs as given; a key the proposer does not know, or JSON that is
    not an object, is refused by the parser (before a server starts) and names the known keys."""
    parser = _rl_demo_module().build_parser()
    given = {"cost_aware": False, "min_confidence": 0.1}
    assert parser.parse_args(["--history-config", json.dumps(given)]).history_config == given
    assert parser.parse_args([]).history_config is None
    for bad in ('{"cost_awre": false}', "[0.1]", '{"min_confidence": 2}', "{not json"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--history-config", bad])
        err = capsys.readouterr().err
        assert "--history-config" in err and ("known:" in err or "cost_awre" not in bad), err


def test_a_new_run_inherits_nothing_an_earlier_run_of_its_mode_left(tmp_path):
    """A second `make demo` reuses the work directory: its report must read only its own trainer's publish
    verdicts (the trainer appends to its log, named by ``DraftTrainerProcess``), and its trainer must start
    from the draft the new engine serves, not resume the earlier run's checkpoint."""
    from vllm_specrl.rl.draft_trainer import DraftTrainerProcess, publish_gate_verdicts

    harness = _harness_module()
    earlier = DraftTrainerProcess(None, tmp_path, "spec").log
    earlier.write_text(json.dumps({"time": 1.0, "step": 4, "policy_version": 1,
                                   "gate": {"publish": True, "reason": "better"}}) + "\n")
    assert len(publish_gate_verdicts(earlier)) == 1
    for name in ("draft-online-spec", "policy_spec", "policy_head_spec"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.pt").write_text("earlier run")
    other_mode = DraftTrainerProcess(None, tmp_path, "history").log
    other_mode.write_text("{}\n")
    harness.clear_stale_run(tmp_path, "spec")
    assert publish_gate_verdicts(earlier) == []
    assert not any((tmp_path / name).exists() for name in ("draft-online-spec", "policy_spec", "policy_head_spec"))
    assert other_mode.exists()
    harness.clear_stale_run(tmp_path, "spec")  # nothing left to clear: no error
