"""The rollout-history proposer's drafting on Model Runner V2, apart from vLLM's classes (so that it can
be tested on any vLLM): ``speculators.HistorySpeculator`` forwards vLLM's calls here.

What differs from vLLM 0.32's ``custom_class`` path: the runner's request states replace the binding
patch (request ids from the batch, prompt lengths and token history from ``req_states``, the step's k
from ``propose``'s ``num_speculative_tokens``); finished requests join the history when vLLM reports
them; and drafts are verified as token-id drafts (a speculator without a draft model hands vLLM's
rejection sampler no draft distribution), so ``sample_drafts`` is off: each draft token is the heaviest
continuation. Lossless either way (a draft chosen without the target's randomness, verified as a point
mass, leaves the output distribution the target's); what is lost is the acceptance that sampled drafts
gain at T > 0.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from vllm_specrl.proposer.history import HistoryProposer

NO_DRAFT = -1  # what Model Runner V2 reads as "no draft token here"


class HistoryDrafts:
    def __init__(self, vllm_config: Any, device: torch.device, req_states: Any):
        self.proposer = HistoryProposer(vllm_config)
        self.proposer.index.cfg = dataclasses.replace(self.proposer.index.cfg, sample_drafts=False)
        self.req_states = req_states
        max_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.drafts = torch.full((max_reqs, self.proposer.k), NO_DRAFT, dtype=torch.int64, device=device)

    def propose(self, input_batch: Any, num_sampled: torch.Tensor, dummy: bool,
                k_limit: int | None) -> torch.Tensor:
        """``[num_reqs, k]`` draft token ids in batch order, ``NO_DRAFT`` where a row drafts less."""
        n = int(input_batch.num_reqs)
        out = self.drafts[:n]
        out.fill_(NO_DRAFT)
        if dummy or n == 0:
            return out
        slots = input_batch.idx_mapping[:n]
        slots_np = np.asarray(input_batch.idx_mapping_np[:n])
        states = self.req_states
        lengths = states.total_len.gpu[slots].cpu().numpy().astype(np.int64)
        rows = states.all_token_ids.gpu[slots, :max(int(lengths.max()), 1)].cpu().numpy()
        sampled = [[0] * int(s) for s in num_sampled[:n].tolist()]
        batch = SimpleNamespace(req_ids=list(input_batch.req_ids[:n]),
                                num_prompt_tokens=np.asarray(states.prompt_len.np)[slots_np])
        self.proposer.bind_step(batch, k_limit)
        host = np.full((n, self.proposer.k), NO_DRAFT, dtype=np.int64)
        for row, tokens in enumerate(self.proposer.propose(sampled, lengths, rows)):
            host[row, :len(tokens)] = tokens
        out.copy_(torch.from_numpy(host))
        return out

    def finished(self, request_ids: set[str]) -> None:
        self.proposer.retire(request_ids)

    def reset(self) -> None:
        self.proposer.reset()
