"""The engine core's side of the lifecycle (``lifecycle.engine_core``) with stand-in engine objects: what
it does with the workers' answers, the refuse gate on the scheduler, the collapse alarm's one repair and
its verdict, and the state it publishes for the API servers."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from vllm_specrl.lifecycle import state as lifecycle_state
from vllm_specrl.lifecycle.engine_core import DrafterLifecycle, gate_drafting


class Executor:
    def __init__(self, answer: dict):
        self.answer, self.calls = answer, []

    def collective_rpc(self, method, args=()):
        self.calls.append((method, args))
        return [{"ok": True, "drafter": dict(self.answer)}]


def make_core(tmp_path, monkeypatch, drafter: dict, answer: dict | None = None):
    monkeypatch.setattr("vllm_specrl.lifecycle.engine_core.instance_dir", lambda engine_core=False: tmp_path)
    resets = []
    core = NS(vllm_config=NS(additional_config={"specrl": {"drafter": drafter}},
                             parallel_config=NS(data_parallel_index=0, data_parallel_rank=0)),
              scheduler=NS(scheduler_config=NS(max_num_seqs=4), dynamic_sd_lookup=None),
              model_executor=Executor(answer or {"action": "none"}),
              reset_prefix_cache=lambda **kw: resets.append(kw))
    return core, resets


def test_a_repair_resets_the_running_requests_and_is_published(tmp_path, monkeypatch):
    core, resets = make_core(tmp_path, monkeypatch, {}, {"action": "repaired"})
    life = DrafterLifecycle(core)
    life.check(core, "collective_rpc(f)")
    assert resets == [{"reset_running_requests": True}]
    published = lifecycle_state.read_all(tmp_path)[0]
    assert published["repairs"] == {"collective_rpc": 1} and published["last_repair"]["ok"]
    life.check(core, "wake_up")
    assert lifecycle_state.read_all(tmp_path)[0]["repairs"] == {"collective_rpc": 1, "wake_up": 1}


def test_nothing_wrong_changes_nothing(tmp_path, monkeypatch):
    core, resets = make_core(tmp_path, monkeypatch, {})
    DrafterLifecycle(core).check(core, "periodic check")
    assert resets == [] and lifecycle_state.read_all(tmp_path)[0]["repairs"] == {}


def test_refuse_gates_the_scheduler_until_a_draft_update(tmp_path, monkeypatch):
    core, _ = make_core(tmp_path, monkeypatch, {"on_damage": "refuse"}, {"action": "refused"})
    core.scheduler.dynamic_sd_lookup = [3, 3, 2, 2, 1]
    life = DrafterLifecycle(core)
    life.check(core, "collective_rpc(f)")
    assert core.scheduler.dynamic_sd_lookup == [0] * 5 and life.refusing["after"] == "collective_rpc(f)"
    life.check(core, "periodic check")  # still refused: the first cause stays
    assert life.refusing["after"] == "collective_rpc(f)"
    life.handle(core, "draft update", [{"ok": True, "drafter": {"action": "published"}}])
    assert core.scheduler.dynamic_sd_lookup == [3, 3, 2, 2, 1] and life.refusing is None


def test_gating_twice_keeps_the_lookup_to_restore():
    scheduler = NS(scheduler_config=NS(max_num_seqs=2), dynamic_sd_lookup=None)
    gate_drafting(scheduler, refuse=True)
    gate_drafting(scheduler, refuse=True)
    gate_drafting(scheduler, refuse=False)
    assert scheduler.dynamic_sd_lookup is None


@pytest.mark.parametrize("after_repair, recovered", [(2, True), (0, False)])
def test_a_collapse_is_raised_with_its_event_and_repaired_once(tmp_path, monkeypatch, after_repair, recovered):
    core, resets = make_core(tmp_path, monkeypatch, {"collapse_window": 4}, {"action": "repaired"})
    life = DrafterLifecycle(core)
    life.noted("collective_rpc('sleep')")
    life.observe_verified([(3, 2)] * 4)
    life.observe_verified([(3, 0)] * 4)
    alarm = lifecycle_state.read_all(tmp_path)[0]["collapse"]
    assert alarm["active"] and alarm["after_event"]["event"] == "collective_rpc('sleep')" and alarm["repair_tried"]
    life.after_step(core, model_executed=True)  # the pending repair, forced
    assert core.model_executor.calls[-1] == ("specrl_verify_draft", ("collapse", True))
    life.after_step(core, model_executed=False)
    assert len([c for c in core.model_executor.calls if c[1][0] == "collapse"]) == 1  # once
    life.observe_verified([(3, after_repair)] * 4)
    alarm = lifecycle_state.read_all(tmp_path)[0]["collapse"]
    assert alarm["recovered"] is recovered and alarm["active"] is not recovered


def test_report_mode_raises_the_alarm_without_a_repair(tmp_path, monkeypatch):
    core, _ = make_core(tmp_path, monkeypatch, {"collapse_window": 2, "on_damage": "report"})
    life = DrafterLifecycle(core)
    life.observe_verified([(3, 3)] * 2)
    life.observe_verified([(3, 0)] * 2)
    life.after_step(core, model_executed=False)
    assert life.collapse["active"] and not life.collapse["repair_tried"]
    assert life.collapse["after_event"]["event"] == "no event seen" and core.model_executor.calls == []


def test_a_half_loaded_drafter_inside_a_native_session_is_left_alone(monkeypatch):
    """A periodic check that lands between a native session's chunks must not 'repair' the update away."""
    from vllm_specrl.lifecycle import worker as lifecycle_worker
    from vllm_specrl.sync.watch.worker_loads import watch_of

    stand_in = NS(model_runner=NS(drafter=NS(model=object())))
    monkeypatch.setattr(lifecycle_worker, "served_models", lambda w: {"policy": [], "draft": [object()]})
    monkeypatch.setattr(lifecycle_worker, "draft_fingerprint", lambda w: "half-loaded")
    watch = watch_of(stand_in)
    watch.published_fingerprint, watch.session, watch.session_kind = "published", "draft", "native"
    assert lifecycle_worker.verify_draft(stand_in, "periodic check")["action"] == "none"
    watch.session = None
    stand_in._specrl_drafter_config = lifecycle_worker.DrafterConfig(on_damage="report")
    assert lifecycle_worker.verify_draft(stand_in, "periodic check")["action"] == "reported"
