"""vLLM alone: an in-place ``reload_weights`` whose weight iterator raises part way leaves the model
unable to reload again (so nothing can restore the old weights).

vLLM 0.32.0 (cpu), ``model_runner.reload_weights`` -> ``initialize_layerwise_reload`` moves every
layer to the meta device and wraps its weight loaders; layers get real tensors back only once all
their weights arrived, in ``finalize_layerwise_reload``. If the iterator (or a loader) raises, the
finalize never runs, and the next ``reload_weights`` fails with
``AttributeError: 'Parameter' object has no attribute 'weight_loader'``. Calling vLLM's own
``finalize_layerwise_reload`` first makes the second reload work (what
``vllm_specrl.sync.worker.reload.end_interrupted_reload`` does before restoring the last good weights).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/repro/repro_interrupted_reload.py .fixtures/tiny/target
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_PLUGINS", "")  # vLLM alone: no vllm-specrl plugin


def main(model: str) -> int:
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate(["def f(x):"], params, use_tqdm=False)[0].outputs[0].token_ids
    weights = sorted(load_file(os.path.join(model, "model.safetensors")).items())

    def failing(items, after):
        for i, item in enumerate(items):
            if i == after:
                raise RuntimeError("weight source failed part way")
            yield item

    def reload(worker, items):
        worker.model_runner.reload_weights(weights_iterator=iter(items))

    worker_call = llm.llm_engine.model_executor.driver_worker.worker
    try:
        reload(worker_call, failing(weights, 7))
    except RuntimeError as exc:
        print("first reload failed as planted:", exc)
    try:
        reload(worker_call, weights)
        print("second reload: ok (fault not present)")
        fault = False
    except AttributeError as exc:
        print("FAULT: second reload of the full, valid weights failed:", repr(exc))
        fault = True
    if fault:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model_obj = worker_call.model_runner.get_model()
        finalize_layerwise_reload(model_obj, worker_call.vllm_config.model_config)
        reload(worker_call, weights)
        after = llm.generate(["def f(x):"], params, use_tqdm=False)[0].outputs[0].token_ids
        print("after vLLM's finalize, a full reload works; outputs restored:", list(after) == list(before))
    return 1 if fault else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".fixtures/tiny/target"))
