"""Policy updates reach the policy's own MTP layers (``"method": "mtp"``, the tiny-mimo fixture).

vLLM's MiMo loader drops ``model.mtp_layers.*`` from the body's weights, so an update
applied to the target alone would leave the drafter proposing for the old policy: greedy
outputs would still be right (verification is lossless) but acceptance would not be the
new checkpoint's. The test compares one in-process engine updated in place against a fresh
engine started on the new checkpoint: outputs and vLLM's own draft counters must be equal.
Updates that omit or mis-shape an MTP tensor are refused naming it, and change nothing; a draft
update carries the MTP layers alone (what the online trainer publishes).

Engines: in-process engines for an updated, a kept and a fresh MiMo checkpoint (exactness against a
fresh engine needs its own), and one `vllm serve` for the EngineClient path.
"""

import json

import pytest
import torch

from helpers import perturbed_checkpoint, result_json, run_python
from prompts import code_prompts

K = 3
MAX_TOKENS = 32
MTP_WEIGHT = "model.mtp_layers.0.input_proj.weight"
MTP_NORM = "model.mtp_layers.0.final_layernorm.weight"


def engine_script(model, updates: list[tuple[str, str]] | None = None, prompts=None) -> str:
    """Greedy outputs and spec-decode counters before and after each update (label, checkpoint or mangle)."""
    return f"""
        import json
        from safetensors.torch import load_file
        from vllm import LLM, SamplingParams
        from vllm_specrl import metrics
        from vllm_specrl.sync.clients.llm import commit_update
        llm = LLM(model={str(model)!r}, dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
                  max_num_seqs=16, disable_log_stats=False,
                  speculative_config={{"method": "mtp", "num_speculative_tokens": {K}}},
                  worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension")
        prompts = json.loads({json.dumps(json.dumps(prompts))})

        def run():
            before = metrics.from_llm_metrics(llm.get_metrics())
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens={MAX_TOKENS}, ignore_eos=True),
                                use_tqdm=False)
            stats = metrics.from_llm_metrics(llm.get_metrics()).minus(before).summary()
            # Which requests the counters cover is the same in every run; print them for a failing diff.
            print("RUN", stats["num_drafts"], stats["num_accepted_tokens"], flush=True)
            return {{"tokens": [list(o.outputs[0].token_ids) for o in outs],
                     "drafts": stats["num_drafts"], "accepted": stats["num_accepted_tokens"]}}

        result = {{"runs": [run()], "answers": []}}
        for version, (label, source) in enumerate(json.loads({json.dumps(json.dumps(updates or []))}), 1):
            tensors = load_file((source or {str(model)!r}) + "/model.safetensors")
            target, keep_mtp = "policy", label in ("body-keep", "keep-with-mtp")
            if label == "misshaped":
                tensors[{MTP_WEIGHT!r}] = tensors[{MTP_WEIGHT!r}][:, :-1].contiguous()
            elif label == "missing":
                del tensors[{MTP_NORM!r}]
            elif label == "body-keep":
                tensors = {{k: v for k, v in tensors.items() if not k.startswith("model.mtp_layers.")}}
            elif label == "mtp-draft":
                target = "draft"
                tensors = {{k: v for k, v in tensors.items() if k.startswith("model.mtp_layers.")}}
            answer = commit_update(llm, target, tensors, version, keep_mtp=keep_mtp)
            result["answers"].append({{"label": label, "ok": answer["ok"], "error": answer.get("error"),
                                      "problems": answer.get("problems", [])}})
            result["runs"].append(run())
        print("RESULT " + json.dumps(result))
    """


@pytest.fixture(scope="module")
def new_policy(mimo_model, tmp_path_factory):
    """Every matrix moved, the MTP layer's much more (an RL step on a model that trains its MTP too):
    a drafter left on the old MTP weights drafts measurably differently."""
    from safetensors.torch import load_file, save_file

    out = perturbed_checkpoint(mimo_model, tmp_path_factory.mktemp("mtp-policy") / "v1", seed=0, scale=0.1)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, tensor in tensors.items():
        if name.startswith("model.mtp_layers.") and tensor.dim() == 2:
            tensors[name] = tensor + 0.5 * tensor.std() * torch.randn(tensor.shape, generator=gen)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def prompts():
    return code_prompts(40)[24:36]


@pytest.fixture(scope="module")
def updated(mimo_model, new_policy, prompts):
    updates = [("misshaped", ""), ("missing", ""), ("checkpoint", str(new_policy))]
    return result_json(run_python(engine_script(mimo_model, updates, prompts), env={"VLLM_PLUGINS": "specrl"}))


@pytest.fixture(scope="module")
def kept(mimo_model, new_policy, prompts):
    """The RL shape with an online MTP trainer: the policy trainer sends the body alone
    (``keep_mtp``) and the MTP layer arrives separately as a draft update."""
    updates = [("keep-with-mtp", str(new_policy)), ("mtp-draft", str(new_policy)), ("body-keep", str(new_policy))]
    return result_json(run_python(engine_script(mimo_model, updates, prompts), env={"VLLM_PLUGINS": "specrl"}))


@pytest.fixture(scope="module")
def fresh(new_policy, prompts):
    return result_json(run_python(engine_script(new_policy, [], prompts), env={"VLLM_PLUGINS": "specrl"}))["runs"][0]


def test_bad_mtp_tensors_are_refused_by_name_and_change_nothing(updated):
    misshaped, missing = updated["answers"][:2]
    assert not misshaped["ok"] and any(p.startswith(f"{MTP_WEIGHT}: shape") for p in misshaped["problems"]), misshaped
    assert not missing["ok"] and f"{MTP_NORM}: missing" in missing["problems"], missing
    before, after_misshaped, after_missing = updated["runs"][:3]
    assert after_misshaped == before and after_missing == before


def test_update_policy_moves_the_mtp_drafter_with_the_body(updated, fresh):
    before, after = updated["runs"][0], updated["runs"][-1]
    assert updated["answers"][-1]["ok"], updated["answers"][-1]
    assert after["tokens"] == fresh["tokens"] and after["tokens"] != before["tokens"]
    # The drafter's proposals equal a fresh engine's on the new checkpoint, to the token: same counts.
    assert (after["drafts"], after["accepted"]) == (fresh["drafts"], fresh["accepted"]), (after, fresh)


def test_a_body_only_update_keeps_the_served_mtp_layer(kept, fresh):
    """``keep_mtp``: the online trainer's MTP layer (here the new checkpoint's, published as a draft
    update onto the old body) stays through a body-only policy update; MTP tensors sent with one
    are refused by name. The end state is exactly a fresh engine on the new checkpoint."""
    refused, layer, body = kept["answers"]
    assert not refused["ok"] and any(p.startswith("model.mtp_layers.") and "unknown parameter name" in p
                                     for p in refused["problems"]), refused
    assert body["ok"] and layer["ok"], kept["answers"]
    before, after_refused, after_layer, after_body = kept["runs"]
    assert after_refused == before
    # The new layer drafts for the old body: other drafts, the same (lossless) tokens.
    assert after_layer["tokens"] == before["tokens"]
    assert (after_layer["drafts"], after_layer["accepted"]) != (before["drafts"], before["accepted"])
    # The body moves and the published layer stays: vLLM's counters equal the fresh engine's.
    assert after_body["tokens"] == fresh["tokens"]
    assert (after_body["drafts"], after_body["accepted"]) == (fresh["drafts"], fresh["accepted"]), (after_body, fresh)


@pytest.mark.server
def test_served_mtp_engine_refits_through_the_engine_client(mimo_model, new_policy, prompts, fresh, tmp_path):
    """The same refit through ``vllm serve`` and ``EngineClient`` (shared memory), as an RL job does it."""
    import requests
    from safetensors.torch import load_file

    from vllm_specrl.launcher import VLLMServer, cpu_env
    from vllm_specrl.sync.clients.engine_client import EngineClient, WeightSyncError

    spec = {"method": "mtp", "num_speculative_tokens": K}
    args = ["--dtype", "float32", "--max-model-len", "512", "--speculative-config", json.dumps(spec)]
    with VLLMServer(mimo_model, args, api_key="k", log_path=tmp_path / "serve.log", env=cpu_env()) as srv:
        client = EngineClient(srv.url, api_key="k", progress=False)

        def served_tokens() -> list[list[int]]:
            r = requests.post(srv.url + "/v1/completions", headers=srv.headers, timeout=300, json={
                "model": srv.model, "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            r.raise_for_status()
            return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

        # A draft update on an MTP engine carries its MTP layers only (the online trainer's): a body
        # tensor is refused by name; the MTP tensors alone are taken (and change no served token).
        policy_tensors = load_file(mimo_model / "model.safetensors")
        with pytest.raises(WeightSyncError, match="model.embed_tokens.weight: unknown parameter name"):
            client.update_draft(policy_tensors, version=1)
        mtp_only = {k: v for k, v in policy_tensors.items() if k.startswith("model.mtp_layers.")}
        assert client.update_draft(mtp_only, version=1)["version"] == 1
        assert client.update_policy(load_file(new_policy / "model.safetensors"), version=1)["version"] == 1
        assert served_tokens() == fresh["tokens"]
        stale = client.status()["stale_draft"]
        assert stale["version_lag"] == 0 and not stale["stale"], stale
