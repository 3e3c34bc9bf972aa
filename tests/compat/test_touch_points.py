"""The touch-point list is the registry's, and it holds against the installed vLLM: every patched
function and every internal read exists in vLLM's source with what the package uses, every patch's
signature check would pass, and the docs' table is the registry's. A signature drift that would make a
patch skip (what vLLM 0.33's ``rejection_sample`` would have done to the padded-draft fix) is a failure
of the check, not a silent skip."""

from __future__ import annotations

from pathlib import Path

import vllm

from vllm_specrl import patches  # noqa: F401 - declares every patch and read
from vllm_specrl.compat.registry import REGISTRY
from vllm_specrl.compat.source_check import compare, patch_signatures, runner_of_source, skipped_patches

from helpers import load_script

REPO = Path(__file__).resolve().parents[2]


def _script():
    return load_script("scripts/check_vllm_touch_points.py")


def test_every_touch_point_holds_in_the_installed_vllm():
    root = Path(vllm.__file__).parents[1]
    assert runner_of_source(root) == "v1"   # vLLM 0.32: the V1 runner serves speculators
    rows, failures = compare(REGISTRY, root, root)
    assert failures == 0, [r for r in rows if r["verdict"] not in ("same", "same (touched names present)")]
    names = {(row["file"], row["name"]) for row in rows}
    for patch in REGISTRY.patches():  # every patch's target is among them
        point = patch.touch_point()
        assert (f"vllm/{point.file}", point.name) in names, patch.name


def test_a_signature_drift_that_would_skip_a_patch_is_reported():
    accepted = patch_signatures(REGISTRY)[("v1/sample/rejection_sampler.py", "rejection_sample")]
    as_on_0_32 = ["draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens", "draft_probs",
                  "target_logits", "bonus_token_ids", "sampling_metadata", "synthetic_mode=",
                  "synthetic_conditional_rates=", "use_fp64_gumbel="]
    assert skipped_patches(as_on_0_32, accepted) == []
    # vLLM 0.33.0's: the patch was written for it too
    assert skipped_patches(as_on_0_32 + ["fly_window_size=", "fly_entropy_threshold=", "fly_entropy_top_k="],
                           accepted) == []
    # a parameter the patch does not know
    assert skipped_patches(as_on_0_32 + ["new_option="], accepted) == ["cpu_fast_sampling.lazy_rejection"]
    # a patch on one runner object sees the bound method: its class's ``self`` is not a drift
    tap = patch_signatures(REGISTRY)[("v1/worker/gpu_model_runner.py", "GPUModelRunner.propose_draft_token_ids")]
    signature = ["self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                 "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
                 "slot_mappings"]
    assert skipped_patches(signature, tap) == []
    assert set(skipped_patches(signature[:-1], tap)) == {"capture_tap", "draft_recorder"}


def test_the_docs_table_is_the_registrys():
    expected = _script().markdown_table()
    assert (REPO / "docs" / "vllm_touch_points.md").read_text() == expected, (
        "docs/vllm_touch_points.md is stale: python scripts/check_vllm_touch_points.py "
        "--markdown docs/vllm_touch_points.md")


def test_the_checked_0_33_report_covers_the_registry():
    """The committed check of vLLM 0.33.0's source (not run here: it needs the wheel) was made from this
    registry's list, and found nothing missing, changed or skipping a patch."""
    import json

    report = json.loads((REPO / "docs" / "vllm_0.33.0_touch_points.json").read_text())
    assert report["checked"]["version"] == "0.33.0" and report["missing_or_changed"] == 0
    assert {(r["file"], r["name"]) for r in report["rows"]} == {
        (f"vllm/{p.file}", p.name or p.kind) for p in REGISTRY.touch_points("v1")}


def test_the_checked_0_34_report_covers_what_model_runner_v2_needs():
    """The committed check of vLLM 0.34.0's source (``make check-vllm VERSION=0.34.0``) was made from this
    registry's list for Model Runner V2: every touch point the port and the carried-over patches rely on,
    and none of the V1 runner's, holds there."""
    import json

    report = json.loads((REPO / "docs" / "vllm_0.34.0_touch_points.json").read_text())
    assert report["checked"]["version"] == "0.34.0" and report["checked"]["runner"] == "mrv2"
    assert report["missing_or_changed"] == 0
    expected = {(f"vllm/{p.file}", p.name or p.kind) for p in REGISTRY.touch_points("mrv2")}
    assert {(r["file"], r["name"]) for r in report["rows"]} == expected
    assert not any(p.runner == "v1" for p in REGISTRY.touch_points("mrv2"))
    assert {r["runner"] for r in report["rows"]} == {"any", "mrv2"}


def _tree(tmp_path: Path, propose_params: str, registry: bool = True) -> Path:
    sd = tmp_path / "vllm" / "v1" / "worker" / "gpu" / "spec_decode"
    sd.mkdir(parents=True)
    (sd / "speculator_config.py").write_text(
        "def register_speculative_method(name, config_cls):\n    pass\n" if registry else "X = 1\n")
    (sd / "speculator.py").write_text(
        f"class BaseSpeculator:\n    def propose(self, {propose_params}):\n        pass\n")
    return tmp_path


def test_a_model_runner_v2_signature_drift_fails_the_check(tmp_path):
    """A touch point with the signatures it was written for is held to them, whatever the reference says."""
    from vllm_specrl.compat.registry import Registry, TouchPoint
    from vllm_specrl.mrv2.touch_points import _PROPOSE

    registry = Registry()
    registry.reads(TouchPoint("v1/worker/gpu/spec_decode/speculator.py", "BaseSpeculator.propose", "function",
                              "test", runner="mrv2", signatures=(_PROPOSE,)))
    params = ", ".join(p.replace("=", "=None") for p in _PROPOSE[1:])
    same = _tree(tmp_path / "same", params)
    assert runner_of_source(same) == "mrv2"
    rows, failures = compare(registry, same, same)
    assert failures == 0 and rows[0]["verdict"].startswith("same")
    drifted = _tree(tmp_path / "drift", params.replace("num_rejected, ", ""))
    rows, failures = compare(registry, same, drifted)
    assert failures == 1 and rows[0]["verdict"] == "changed"
    v1 = _tree(tmp_path / "v1", params, registry=False)
    assert runner_of_source(v1) == "v1" and compare(registry, same, v1)[0] == []   # not checked on a V1 vLLM
