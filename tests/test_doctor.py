"""``vllm-specrl doctor`` on this machine's vLLM: every declared patch is listed with its state in the
doctor's process, as a model-running vLLM process would install it; a switch set to 0 shows as such; on
a platform that is not the CPU (stubbed) the CPU-scoped patches are skipped with the switch that turns
them on while the ones needed everywhere install; an installer that raises is reported as failed and
turns the exit status to 1.

Engines: none; four interpreters (forked from the suite's zygote), one per state of the process the
doctor reports on (its registry is process-wide and installs once)."""

from __future__ import annotations

import json
import os

from helpers import run_python

from vllm_specrl import patches  # noqa: F401 - declares every patch
from vllm_specrl.compat.registry import CPU_ONLY_NOTE, REGISTRY

DIAGNOSE = """
import json
{before}
from vllm_specrl.doctor import diagnose, format_report
found = diagnose()
print(format_report(found))
print("DOCTOR " + json.dumps(found))
"""


def _doctor(before: str = "", env: dict | None = None) -> tuple[dict, str]:
    out = run_python(DIAGNOSE.format(before=before), env=env)
    line = next(line for line in out.splitlines() if line.startswith("DOCTOR "))
    return json.loads(line[len("DOCTOR "):]), out


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


def test_off_the_cpu_the_cpu_scoped_patches_stay_off_and_say_how_to_switch_them_on():
    found, _ = _doctor("from vllm.platforms import current_platform\ncurrent_platform.is_cpu = lambda: False")
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
    planted = ("from vllm_specrl import patches\n"
               "def boom():\n    raise RuntimeError('planted')\n"
               "patches.WORKER = (patches.Step('zero_draft_plain_sampler', 'x', boom, "
               "('zero_draft_plain_sampler',)),)")
    found, out = _doctor(planted)
    row = next(row for row in found["patches"] if row["name"] == "zero_draft_plain_sampler")
    assert row["state"] == "failed" and "planted" in row["detail"]
    assert not found["ok"] and "doctor: PROBLEMS" in out
