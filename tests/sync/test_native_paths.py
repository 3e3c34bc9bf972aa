"""Whatever path loads the weights, the guarantees hold (``sync.watch.worker_loads``,
``sync.watch.engine_core_events``).

An in-process ``LLM`` (tiny model, float32, a random EAGLE-3 draft with a reduced vocabulary) with the
worker extension takes policy updates by every path an RL framework uses and, after each, the version
the workers serve (what capture frames and the history proposer read) advances, the prefix cache was
reset (the same prompt again finds no cached block) and the served tokens are the new weights': vLLM's
native API with a label (``finish_weight_update(weight_version="5")``), ``reload_weights`` through
``collective_rpc`` (counted), and a user's function calling ``model.load_weights`` in the worker, as
verl- and NeMo-RL-style extensions do (counted). A native draft update whose ``d2t`` maps outside the
vocabulary is refused with the reason before anything of it loads and the engine serves on unchanged
(vLLM alone leaves its layerwise reload half done and every later step fails); a drafter whose weights
are changed behind the plugin's back (zeroed in place) is seen by its fingerprint and repaired from the
host copy (``vllm_specrl.lifecycle``; tests/lifecycle/ checks what it serves afterwards).

What would fail: a path whose change is not counted (version stays), a label not taken, the prefix cache
not reset (the prompt hits its old blocks), a draft refused only after part of it loaded (outputs
change or the engine fails), an emptied drafter not repaired.

Engines: one in-process engine (``in_engine_process``); its outputs compared with its own before/after.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import in_engine_process, perturbed_checkpoint

pytestmark = pytest.mark.server


@in_engine_process(env={"VLLM_PLUGINS": "specrl"}, timeout=900)
def every_load_path(tiny_model: Path, moved: Path, draft_dir: Path) -> dict:
    """One engine through every load path in turn; what it served and its versions after each."""
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from vllm_specrl.sync.shm import write_chunk

    llm = LLM(model=str(tiny_model), dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              enable_prefix_caching=True, disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": 2},
              weight_transfer_config={"backend": "specrl_shm"},
              worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension")
    prompt = "def fibonacci(n):\n    " * 30  # CPU blocks hold 128 tokens: two full blocks
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def hits() -> float:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")

    def served() -> list:
        """[the greedy tokens, the prefix-cache hits they took]."""
        before = hits()
        tokens = list(llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids)
        return [tokens, hits() - before]

    def state() -> dict:
        s = llm.collective_rpc("specrl_status")[0]
        return {"versions": s["sync"]["versions"], "watch": s["weight_watch"]}

    report = {"base": served()}
    report["base_again"] = served()  # the prompt's blocks are cached now
    old = load_file(str(tiny_model / "model.safetensors"))
    new = load_file(str(moved / "model.safetensors"))

    # 1. vLLM's native API, labelled
    paths = [write_chunk(dict(list(new.items())[:10])), write_chunk(dict(list(new.items())[10:]))]
    llm.init_weight_transfer_engine({"init_info": {}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"paths": [str(p) for p in paths]}})
    llm.finish_weight_update(weight_version="5")
    for path in paths:
        path.unlink()
    report["native"] = {"served": served(), **state()}

    # 2. reload_weights through collective_rpc (back to the old weights): counted
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(old.items())})
    report["reload"] = {"served": served(), **state()}

    # 3. a user's function loading into the model in the worker (verl / NeMo-RL style; on CPU through
    # the runner's layerwise reload, which calls the model's load_weights): counted
    def user_load(self, items=list(new.items())):
        self.model_runner.reload_weights(weights_iterator=items)
    llm.collective_rpc(user_load)
    report["user"] = {"served": served(), **state()}

    # 4. a native draft update whose d2t maps outside the vocabulary: refused, nothing of it loaded
    draft = load_file(str(draft_dir / "model.safetensors"))
    bad = dict(draft)
    bad["d2t"] = draft["d2t"].clone()
    bad["d2t"][-1] = 10 ** 6
    path = write_chunk(bad)
    llm.start_draft_weight_update()
    try:
        llm.update_weights({"update_info": {"paths": [str(path)]}})
        report["bad_draft"] = "accepted"
    except Exception as exc:  # noqa: BLE001 - the refusal is what is recorded
        report["bad_draft"] = str(exc)
    path.unlink()
    report["after_bad_draft"] = {"served": served(), **state()}

    # 4b. the same draft from a user's function, through vLLM's layerwise reload of the drafter
    def user_draft_load(self, items=list(bad.items())):
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
        reload_weights(self.vllm_config, self.model_runner.drafter.model, weights_iterator=items,
                       weights_path=None, is_checkpoint_format=True)
    try:
        llm.collective_rpc(user_draft_load)
        report["bad_user_draft"] = "accepted"
    except Exception as exc:  # noqa: BLE001 - the refusal is what is recorded
        report["bad_user_draft"] = str(exc)
    report["after_bad_user_draft"] = {"served": served(), **state()}

    # 5. a valid native draft update: counted for the draft
    path = write_chunk(draft)
    llm.start_draft_weight_update()
    llm.update_weights({"update_info": {"paths": [str(path)]}})
    llm.finish_weight_update()
    path.unlink()
    report["draft"] = state()

    # 6. the drafter's weights zeroed behind the plugin's back
    def zero_draft(self):
        with torch.no_grad():
            for module in self.model_runner.drafter.model.modules():
                weight = getattr(module, "weight", None)
                if weight is not None and weight.numel() and module.__class__.__name__ == "RMSNorm":
                    weight.zero_()
    llm.collective_rpc(zero_draft)
    report["zeroed"] = state()
    return report


@pytest.fixture(scope="module")
def native_run(tiny_model, tmp_path_factory):
    from vllm_specrl.proposer.checkpoint import init_draft

    work = tmp_path_factory.mktemp("native")
    moved = perturbed_checkpoint(tiny_model, work / "moved", seed=3)
    init_draft(tiny_model, work / "draft", 1024, seed=0)
    return every_load_path(tiny_model, moved, work / "draft")


def test_every_policy_path_advances_the_version_and_resets_the_prefix_cache(native_run):
    r = native_run
    base_tokens, _ = r["base"]
    assert r["base_again"] == [base_tokens, r["base_again"][1]] and r["base_again"][1] > 0  # cached blocks hit
    expected = {"native": 5, "reload": 6, "user": 7}  # the label, then counted
    for path, version in expected.items():
        tokens, hits = r[path]["served"]
        assert r[path]["versions"]["policy"] == version, (path, r[path])
        assert hits == 0, (path, "the prefix cache served blocks of the old weights")
        assert (tokens == base_tokens) == (path == "reload"), (path, tokens, base_tokens)
    assert [e["path"] for e in r["user"]["watch"]["events"] if e["event"] == "loaded"] == \
        ["native weight transfer", "reload_weights", "load_weights"]


def test_a_malformed_native_draft_update_is_refused_and_serving_is_unchanged(native_run):
    r = native_run
    assert "d2t" in r["bad_draft"] and "outside the target vocabulary" in r["bad_draft"], r["bad_draft"]
    assert r["after_bad_draft"]["served"][0] == r["user"]["served"][0]
    assert r["after_bad_draft"]["versions"] == {"policy": 7, "draft": 0}
    assert r["draft"]["versions"] == {"policy": 7, "draft": 1}
    assert r["after_bad_draft"]["watch"]["draft_mismatch"] is None  # restored exactly
    # the same draft loaded by a user's function: refused by the watch itself, the reload repaired
    assert "d2t" in r["bad_user_draft"] and "refused before loading" in r["bad_user_draft"], r["bad_user_draft"]
    assert r["after_bad_user_draft"]["served"][0] == r["user"]["served"][0]
    assert r["after_bad_user_draft"]["versions"] == {"policy": 7, "draft": 0}
    assert r["after_bad_user_draft"]["watch"]["draft_mismatch"] is None


def test_a_drafter_changed_behind_the_plugins_back_is_repaired(native_run):
    r = native_run
    assert r["draft"]["watch"]["draft_mismatch"] is None
    watch = r["zeroed"]["watch"]
    assert watch["repairs"] == {"collective_rpc": 1} and watch["draft_mismatch"] is None, watch
    assert watch["last_repair"]["repaired"] and "zero_draft" in watch["last_repair"]["after"]
