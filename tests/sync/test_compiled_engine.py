"""vLLM's default mode: a compiled engine (``torch.compile``; what ``vllm serve`` runs unless told
``--enforce-eager``, and on a GPU the mode its CUDA graphs replay) with the plugin stays lossless, and
an in-place policy update reaches the compiled graph.

Every other engine test runs eager, as the project's servers do on CPU. A compiled graph holds the
tensors it traced: an update that swapped a parameter or a oneDNN weight handle instead of writing
into them would leave the graph serving the old policy while every counter says the new one loaded.
Here one compiled engine with the plugin (warm EAGLE-3 draft, adaptive k, the worker extension)
serves greedy answers, takes the moved policy through vLLM's native weight-transfer API, and serves
again; the references are two compiled engines without the plugin, on the old and on the moved
weights.

What would fail: drafts that change a greedy token under compilation, an update that the compiled
graph does not see (answers still the old policy's), an update not counted.

Engines: three compiled in-process engines (about a minute each to compile on 2 cores).
"""

from __future__ import annotations

import pytest

from helpers import result_json, run_python
from prompts import code_prompts
from sampling import greedy_generate
from vllm_specrl.adaptive import SCHEDULER_CLS

pytestmark = pytest.mark.slow
PROMPTS = code_prompts(8)
MAX_TOKENS = 32


def compiled_speculative_run(model, draft, update) -> dict:
    """Greedy answers of a fresh compiled engine with the plugin (``draft``, adaptive k, the worker
    extension), then its answers again after the ``update`` checkpoint arrives through vLLM's native
    weight-transfer API (the plugin's shared-memory engine)."""
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}
    out = run_python(f"""
        import json
        from safetensors.torch import load_file
        from vllm import LLM, SamplingParams
        from vllm_specrl import metrics
        from vllm_specrl.sync.shm import write_chunk
        llm = LLM(model={str(model)!r}, dtype="float32", enforce_eager=False, seed=0, max_model_len=512,
                  max_num_seqs=16, disable_log_stats=False, speculative_config={spec!r},
                  scheduler_cls={SCHEDULER_CLS!r}, weight_transfer_config={{"backend": "specrl_shm"}},
                  worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension")
        greedy = SamplingParams(temperature=0, max_tokens={MAX_TOKENS}, ignore_eos=True)

        def served():
            return [list(o.outputs[0].token_ids) for o in llm.generate({PROMPTS!r}, greedy, use_tqdm=False)]

        report = {{"tokens": served()}}
        new = load_file({str(update / "model.safetensors")!r})
        names = sorted(new)
        paths = [write_chunk({{n: new[n] for n in names[:10]}}), write_chunk({{n: new[n] for n in names[10:]}})]
        llm.init_weight_transfer_engine({{"init_info": {{}}}})
        llm.start_weight_update()
        llm.update_weights({{"update_info": {{"paths": [str(p) for p in paths]}}}})
        llm.finish_weight_update(weight_version="2")
        for p in paths:
            p.unlink()
        report["updated"] = served()
        report["versions"] = llm.collective_rpc("specrl_status")[0]["sync"]["versions"]
        report["spec_decode"] = metrics.from_llm_metrics(llm.get_metrics()).summary()
        print("RESULT " + json.dumps(report))
    """, env={"VLLM_PLUGINS": "specrl"}, timeout=900)
    return result_json(out)


@pytest.fixture(scope="module")
def references(tiny_model, moved_policy) -> dict[str, list[list[int]]]:
    """Compiled stock vLLM (no plugin) on the old and on the moved weights."""
    return {name: greedy_generate(model, PROMPTS, MAX_TOKENS, plugins="none", compiled=True)["tokens"]
            for name, model in (("original", tiny_model), ("moved", moved_policy))}

def test_a_compiled_engine_is_lossless_and_serves_an_in_place_update(tiny_model, moved_policy, warm_draft,
                                                                      references):
    assert references["moved"] != references["original"], "the moved policy must answer differently"
    run = compiled_speculative_run(tiny_model, warm_draft, moved_policy)
    assert run["tokens"] == references["original"]
    assert run["updated"] == references["moved"], "the compiled graph still serves the old policy"
    assert run["versions"]["policy"] == 2, run["versions"]
    assert run["spec_decode"]["num_drafts"] > 0 and run["spec_decode"]["num_accepted_tokens"] > 0, run["spec_decode"]
