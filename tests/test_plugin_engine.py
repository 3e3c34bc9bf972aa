"""The plugin inside a real engine: declining on an unsupported vLLM leaves vLLM working.

Engines: two in-process engines, one with the plugin declining on a faked vLLM version and one
active: plugin loading happens once per process.
"""

from helpers import result_json, run_python


def test_unsupported_vllm_declines_and_engine_still_generates(tiny_model):
    out = run_python(f"""
        import json
        from vllm_specrl import plugin
        from vllm_specrl.compat import version as vllm_versions
        vllm_versions.vllm_version = lambda: "0.31.0"   # fake an unsupported vLLM
        from vllm import LLM, SamplingParams
        llm = LLM(model={str(tiny_model)!r}, dtype="float32", enforce_eager=True, max_model_len=256,
                  worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension")
        o = llm.generate(["def main("], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        update = llm.collective_rpc("specrl_begin_update", args=("policy", 1))[0]
        capture = llm.collective_rpc("specrl_capture_start", args=("tcp://127.0.0.1:5999",))[0]
        print("RESULT " + json.dumps({{"state": plugin.state(), "n": len(o[0].outputs[0].token_ids),
                                      "update": update, "capture": capture}}))
    """, env={"VLLM_PLUGINS": "specrl"})
    res = result_json(out)
    assert res["state"]["status"] == "declined" and "0.31.0" in res["state"]["reason"]
    assert res["n"] == 8, "vLLM must keep working when the plugin declines"
    warnings = [line for line in out.splitlines() if "registers nothing" in line]
    assert len(warnings) == 1 and ">=0.32,<0.35" in warnings[0]
    # the package's features refuse with the reason rather than run without the plugin's watch
    for answer in (res["update"], res["capture"]):
        assert answer["ok"] is False and "0.31.0" in answer["error"]


def test_supported_vllm_activates_in_process(tiny_model):
    out = run_python(f"""
        import json
        from vllm import LLM, SamplingParams
        from vllm_specrl import plugin
        llm = LLM(model={str(tiny_model)!r}, dtype="float32", enforce_eager=True, max_model_len=256,
                  worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension")
        (worker,) = llm.collective_rpc("specrl_status")
        print("RESULT " + json.dumps({{"state": plugin.state(), "worker": worker}}))
    """, env={"VLLM_PLUGINS": "specrl"})
    res = result_json(out)
    assert res["state"]["status"] == "active"
    assert res["worker"]["plugin"]["status"] == "active" and res["worker"]["model"] == "LlamaForCausalLM"
    assert "cpu_malloc_tuning: installed" in res["worker"]["plugin"]["registrations"], res["worker"]["plugin"]
