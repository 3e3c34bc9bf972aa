"""The plugin inside a real engine: declining on an unsupported vLLM leaves vLLM working.

Engines: two in-process engines, one with the plugin declining on a faked vLLM version and one
active: plugin loading happens once per process.
"""

from pathlib import Path

from helpers import in_engine_process


@in_engine_process(env={"VLLM_PLUGINS": "specrl"}, with_output=True)
def engine_on_an_unsupported_vllm(tiny_model: Path) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_specrl import plugin
    from vllm_specrl.compat import version as vllm_versions

    vllm_versions.vllm_version = lambda: "0.31.0"  # fake an unsupported vLLM
    llm = LLM(model=str(tiny_model), dtype="float32", enforce_eager=True, max_model_len=256,
              worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension")
    o = llm.generate(["def main("], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return {"state": plugin.state(), "n": len(o[0].outputs[0].token_ids),
            "update": llm.collective_rpc("specrl_begin_update", args=("policy", 1))[0],
            "capture": llm.collective_rpc("specrl_capture_start", args=("tcp://127.0.0.1:5999",))[0]}


@in_engine_process(env={"VLLM_PLUGINS": "specrl"})
def engine_on_the_installed_vllm(tiny_model: Path) -> dict:
    from vllm import LLM

    from vllm_specrl import plugin

    llm = LLM(model=str(tiny_model), dtype="float32", enforce_eager=True, max_model_len=256,
              worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension")
    (worker,) = llm.collective_rpc("specrl_status")
    return {"state": plugin.state(), "worker": worker}


def test_unsupported_vllm_declines_and_engine_still_generates(tiny_model):
    res, out = engine_on_an_unsupported_vllm(tiny_model)
    assert res["state"]["status"] == "declined" and "0.31.0" in res["state"]["reason"]
    assert res["n"] == 8, "vLLM must keep working when the plugin declines"
    warnings = [line for line in out.splitlines() if "registers nothing" in line]
    assert len(warnings) == 1 and ">=0.32,<0.35" in warnings[0]
    # the package's features refuse with the reason rather than run without the plugin's watch
    for answer in (res["update"], res["capture"]):
        assert answer["ok"] is False and "0.31.0" in answer["error"]


def test_supported_vllm_activates_in_process(tiny_model):
    res = engine_on_the_installed_vllm(tiny_model)
    assert res["state"]["status"] == "active"
    assert res["worker"]["plugin"]["status"] == "active" and res["worker"]["model"] == "LlamaForCausalLM"
    assert "cpu_malloc_tuning: installed" in res["worker"]["plugin"]["registrations"], res["worker"]["plugin"]
