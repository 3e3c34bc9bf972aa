"""``vllm-specrl doctor`` on this machine's vLLM: every declared patch is listed with its state in the
doctor's process, as a model-running vLLM process would install it; a switch set to 0 shows as such; on
a platform that is not the CPU (stubbed) the CPU-scoped patches are skipped with the switch that turns
them on while the ones needed everywhere install; an installer that raises is reported as failed and
turns the exit status to 1.

Engines: none; five interpreters (``run_function``: forked from the suite's zygote), one per state of the
process the doctor reports on (its registry is process-wide and installs once)."""

from __future__ import annotations

import os

from helpers import run_function

from vllm_specrl import patches  # noqa: F401 - declares every patch
from vllm_specrl.compat.registry import CPU_ONLY_NOTE, REGISTRY

def diagnose_here(off_the_cpu: bool = False, failing_installer: bool = False) -> dict:
    """The doctor in this (child) process: optionally with vLLM's platform stubbed as not the CPU, or with
    one installer planted to raise. Prints the report, as the command does."""
    if off_the_cpu:
        from vllm.platforms import current_platform

        current_platform.is_cpu = lambda: False
    if failing_installer:
        from vllm_specrl import patches

        def boom() -> str:
            raise RuntimeError("planted")

        patches.WORKER = (patches.Step("zero_draft_plain_sampler", "x", boom, ("zero_draft_plain_sampler",)),)
    from vllm_specrl.doctor import diagnose, format_report

    found = diagnose()
    print(format_report(found))
    return found


def _doctor(env: dict | None = None, **how: bool) -> tuple[dict, str]:
    return run_function(diagnose_here, env=env, with_output=True, **how)


def test_doctor_lists_every_patch_installed_where_it_applies():
    found, out = _doctor()
    rows = {row["name"]: row for row in found["patches"]}
    assert set(rows) == {patch.name for patch in REGISTRY.patches()}
    assert found["ok"] and found["supported"] and found["platform"]["is_cpu"]
    assert found["model_runner"] == "v1"   # vLLM 0.32: the port's reads are not this vLLM's to hold
    assert found["touch_points"]["checked"] == len(REGISTRY.touch_points("v1")) and not found["touch_points"]["failing"]
    per_object = {"capture_tap", "capture_tap.sample_tokens", "capture_tap.compute_logprobs", "draft_recorder",
                  "deferred_draft_kv.propose", "weight_watch.load_weights", "native_api.collective_rpc",
                  "native_api.update_weight_version", "native_api.wake_up", "drafter_lifecycle.update_from_output"}
    for name, row in rows.items():
        if name in per_object:  # installed per runner, drafter, served model or engine client, once one exists
            assert row["state"] == "declared", row
        elif name == "cpu_start_method":  # the suite's engines fork (conftest); a user's spawn unless asked
            forked = os.environ.get("VLLM_SPECRL_CPU_START_METHOD") == "fork"
            assert row["state"] == ("installed" if forked else "skipped"), row
        else:
            assert row["state"] == "installed", row
        assert row["switch"].startswith("VLLM_SPECRL_") and row["why"]
    assert "doctor: OK" in out and "zero_draft_plain_sampler" in out


def test_a_switch_set_to_zero_shows_the_patch_off():
    found, _ = _doctor(env={"VLLM_SPECRL_ZERO_DRAFT_PLAIN_SAMPLER": "0"})
    row = next(row for row in found["patches"] if row["name"] == "zero_draft_plain_sampler")
    assert row["state"] == "skipped" and row["detail"] == "off (VLLM_SPECRL_ZERO_DRAFT_PLAIN_SAMPLER=0)"
    assert found["ok"]


def test_one_switch_turns_every_cpu_shortcut_off_and_leaves_the_fault_fixes():
    found, _ = _doctor(env={"VLLM_SPECRL_CPU_SHORTCUTS": "0"})
    rows = {row["name"]: row for row in found["patches"]}
    # a shortcut whose own switch is set keeps it (the suite sets VLLM_SPECRL_CPU_START_METHOD=fork)
    shortcuts = {p.name for p in REGISTRY.patches() if p.shortcut and not os.environ.get(p.switch)}
    assert {"cpu_fast_sampling.draft_sample", "zero_draft_plain_sampler", "deferred_draft_kv",
            "skip_empty_draft_fetch", "runner_step_timer"} <= shortcuts
    for name in shortcuts:
        row = rows[name]
        if row["state"] != "declared":  # the per-object ones are installed later, gated the same way
            assert row["state"] == "skipped" and "VLLM_SPECRL_CPU_SHORTCUTS=0" in row["detail"], row
    for name in ("cpu_expand_kernel_fix", "cpu_seeded_rewind_fix", "custom_proposer_binding"):
        assert rows[name]["state"] == "installed", rows[name]
    assert found["ok"]


def test_off_the_cpu_the_cpu_scoped_patches_stay_off_and_say_how_to_switch_them_on():
    found, _ = _doctor(off_the_cpu=True)
    rows = {row["name"]: row for row in found["patches"]}
    for name in ("zero_draft_plain_sampler", "deferred_draft_kv", "skip_empty_draft_fetch",
                 "cpu_fast_sampling.one_pass_verify", "runner_step_timer"):
        assert rows[name]["state"] == "skipped" and CPU_ONLY_NOTE in rows[name]["detail"], rows[name]
        assert f"{rows[name]['switch']}=1" in rows[name]["detail"]
    for name in ("cpu_expand_kernel_fix", "cpu_seeded_rewind_fix"):  # fault fixes: the fault is the CPU's
        assert rows[name]["state"] == "skipped" and "not the CPU platform" in rows[name]["detail"], rows[name]
    assert rows["custom_proposer_binding"]["state"] == "installed"  # needed on every platform
    assert found["ok"]


def test_an_installer_that_raises_is_reported_failed_and_fails_the_doctor():
    found, out = _doctor(failing_installer=True)
    row = next(row for row in found["patches"] if row["name"] == "zero_draft_plain_sampler")
    assert row["state"] == "failed" and "planted" in row["detail"]
    assert not found["ok"] and "doctor: PROBLEMS" in out
