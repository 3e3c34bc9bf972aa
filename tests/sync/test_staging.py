"""Validation and the update state machine: every refusal names the tensor and changes nothing."""

import pytest
import torch

from vllm_specrl.sync.worker.staging import UpdateStager
from vllm_specrl.sync.worker.validate import ParamSpec, WeightUpdateError, checkpoint_specs

SPECS = {"a.weight": ParamSpec((4, 3), torch.bfloat16), "b.bias": ParamSpec((4,), torch.float32),
         "d2t": ParamSpec((5,), torch.int64)}


def good() -> dict:
    return {"a.weight": torch.randn(4, 3), "b.bias": torch.zeros(4, dtype=torch.bfloat16),
            "d2t": torch.arange(5)}


def begun(stager=None):
    stager = stager or UpdateStager()
    return stager, stager.begin("policy", 1, SPECS).update_id


def test_full_update_commits_and_bumps_version():
    stager, uid = begun()
    tensors = good()
    stager.stage(uid, {"a.weight": tensors["a.weight"]})
    stager.stage(uid, {k: v for k, v in tensors.items() if k != "a.weight"})
    session = stager.ready(uid)
    assert torch.equal(session.staged["a.weight"], tensors["a.weight"])
    tensors["a.weight"].add_(1)  # staged copies are private
    assert not torch.equal(session.staged["a.weight"], tensors["a.weight"])
    stager.finish(session, 0.0)
    assert stager.versions == {"policy": 1, "draft": 0} and stager.session is None


@pytest.mark.parametrize("name, tensor, needle", [
    ("a.weight", torch.randn(3, 4), "a.weight: shape [3, 4] != expected [4, 3]"),
    ("a.weight", torch.ones(4, 3, dtype=torch.int32), "a.weight: dtype torch.int32 is not one of"),
    ("d2t", torch.arange(5, dtype=torch.int32), "d2t: dtype torch.int32 != expected torch.int64"),
    ("c.weight", torch.randn(2), "c.weight: unknown parameter name"),
    ("a.weight", torch.tensor([[float("nan")] * 3] * 4), "a.weight: 12 non-finite values"),
    ("b.bias", torch.tensor([1.0, float("inf"), 0.0, 0.0]), "b.bias: 1 non-finite values"),
    ("b.bias", [1, 2, 3, 4], "b.bias: not a tensor (list)"),
])
def test_bad_tensor_is_refused_by_name_and_poisons_the_update(name, tensor, needle):
    stager, uid = begun()
    with pytest.raises(WeightUpdateError) as err:
        stager.stage(uid, {name: tensor})
    assert needle in str(err.value) and "nothing applied" in str(err.value)
    with pytest.raises(WeightUpdateError, match="failed"):
        stager.ready(uid)
    assert stager.versions["policy"] == 0


def test_truncated_update_cannot_commit():
    stager, uid = begun()
    stager.stage(uid, {"a.weight": torch.randn(4, 3)})
    with pytest.raises(WeightUpdateError, match=r"incomplete \(1 of 3 tensors.*b.bias: missing"):
        stager.ready(uid)


def test_duplicate_tensor_is_refused():
    stager, uid = begun()
    stager.stage(uid, {"a.weight": torch.randn(4, 3)})
    with pytest.raises(WeightUpdateError, match="a.weight: sent twice"):
        stager.stage(uid, {"a.weight": torch.randn(4, 3)})


def test_commit_without_begin_and_concurrent_updates_are_refused():
    stager = UpdateStager()
    with pytest.raises(WeightUpdateError, match="no update in progress"):
        stager.ready("nope")
    _, uid = begun(stager)
    with pytest.raises(WeightUpdateError, match=f"update {uid} .* is in progress"):
        stager.begin("draft", 1, SPECS)
    with pytest.raises(WeightUpdateError, match="is not the one in progress"):
        stager.stage("other", good())
    assert stager.abort(uid)["update_id"] == uid
    stager.begin("draft", 1, SPECS)


def test_versions_must_increase():
    stager = UpdateStager()
    with pytest.raises(WeightUpdateError, match="above the current 0"):
        stager.begin("policy", 0, SPECS)
    with pytest.raises(WeightUpdateError, match="unknown update target"):
        stager.begin("critic", 1, SPECS)


def test_checkpoint_specs_read_headers_and_accept_a_tied_head(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(10, 4, dtype=torch.bfloat16)},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')
    specs = checkpoint_specs(tmp_path)
    assert specs["model.embed_tokens.weight"] == ParamSpec((10, 4), torch.bfloat16)
    assert specs["lm_head.weight"] == specs["model.embed_tokens.weight"]


def commit(stager, version: int, scale: float = 1.0) -> tuple[str, dict]:
    uid = stager.begin("policy", version, SPECS).update_id
    tensors = {k: v * scale if v.is_floating_point() else v for k, v in good().items()}
    stager.stage(uid, tensors)
    stager.finish(stager.ready(uid), 0.0)
    return uid, tensors


def test_last_good_set_and_rollback_of_an_applied_update():
    stager = UpdateStager()
    assert stager.last_good["policy"] is None  # the served checkpoint
    uid1, first = commit(stager, 1)
    assert stager.finalize(uid1) and stager.rollback_point is None
    uid2, _ = commit(stager, 2, scale=2.0)
    # Another rank failed to apply v2: go back to v1's tensors, v1's version.
    target, version, tensors = stager.rolled_back(uid2)
    assert (target, version) == ("policy", 1) and stager.versions["policy"] == 1
    assert torch.equal(tensors["a.weight"], first["a.weight"]) and stager.last_good["policy"] is tensors
    assert stager.last_failure["version"] == 2 and stager.last_failure["serving_version"] == 1
    assert stager.rolled_back(uid2) is None and not stager.finalize(uid2)  # only once


def test_a_failed_apply_closes_the_update_and_keeps_the_version():
    stager = UpdateStager()
    commit(stager, 1)
    uid = stager.begin("policy", 2, SPECS).update_id
    stager.stage(uid, good())
    record = stager.fail(stager.ready(uid), "RuntimeError('loader')", restored=True)
    assert stager.session is None and stager.versions["policy"] == 1
    assert record["failed"] == "RuntimeError('loader')" and record["serving_version"] == 1
    assert stager.last_failure is record
    stager.begin("policy", 2, SPECS)  # the same version may be tried again


def test_optional_tensors_are_checked_when_sent_and_never_required():
    """Weights an engine does not serve (a MiMo checkpoint's MTP layer on a plain engine)."""
    specs = dict(SPECS, **{"mtp.weight": ParamSpec((2, 2), torch.float32, optional=True)})
    stager = UpdateStager()
    uid = stager.begin("policy", 1, specs).update_id
    stager.stage(uid, good())
    stager.finish(stager.ready(uid), 0.0)  # complete without it
    uid = stager.begin("policy", 2, specs).update_id
    with pytest.raises(WeightUpdateError, match=r"mtp.weight: shape \[3\] != expected \[2, 2\]"):
        stager.stage(uid, {"mtp.weight": torch.zeros(3)})
    stager.abort(uid)
    uid = stager.begin("policy", 2, specs).update_id
    stager.stage(uid, dict(good(), **{"mtp.weight": torch.zeros(2, 2)}))
    assert "mtp.weight" in stager.ready(uid).staged


def test_host_bytes_count_private_copies_and_shared_views():
    from vllm_specrl.sync.worker.staging import UpdateStager

    stager = UpdateStager()
    w = torch.ones(4, 8)
    size = w.numel() * w.element_size()
    session = stager.begin("policy", 1, {"w": spec_of(w)})
    stager.stage(session.update_id, {"w": w}, shared=True)
    assert stager.host_bytes()["shared"] == size and stager.host_bytes()["private"] == 0
    stager.finish(stager.ready(session.update_id), 0.0)
    session = stager.begin("policy", 2, {"w": spec_of(w)})
    stager.stage(session.update_id, {"w": w})  # a private copy
    held = stager.host_bytes()
    assert (held["private"], held["shared"], held["staging"], held["last_good"]["policy"]) == (size, size, size, size)
    stager.finish(stager.ready(session.update_id), 0.0)
    assert stager.host_bytes()["rollback_point"] == size  # v1 held until every rank applied v2
    assert stager.finalize(session.update_id)
    assert stager.host_bytes() | {"keep_last_good": None} == {
        "private": size, "shared": 0, "total": size, "staging": 0, "last_good": {"policy": size, "draft": 0},
        "rollback_point": 0, "keep_last_good": None}


def test_without_a_policy_rollback_point_nothing_is_held_after_a_commit():
    from vllm_specrl.sync.worker.staging import DROPPED, UpdateStager

    stager = UpdateStager(keep_last_good={"policy": False})
    w = torch.ones(4, 8)
    for version in (1, 2):
        session = stager.begin("policy", version, {"w": spec_of(w)})
        stager.stage(session.update_id, {"w": w})
        assert stager.host_bytes()["total"] == w.numel() * 4  # the update being staged, alone
        stager.finish(stager.ready(session.update_id), 0.0)
    assert stager.last_good["policy"] == DROPPED and stager.host_bytes()["total"] == 0
    assert stager.rolled_back(session.update_id) == ("policy", 1, DROPPED)  # nothing to re-apply
    session = stager.begin("draft", 1, {"w": spec_of(w)})  # the draft keeps its rollback point
    stager.stage(session.update_id, {"w": w})
    stager.finish(stager.ready(session.update_id), 0.0)
    assert stager.host_bytes()["last_good"]["draft"] == w.numel() * 4


def spec_of(t: torch.Tensor) -> ParamSpec:
    return ParamSpec(tuple(t.shape), t.dtype)
