"""Replay recorded rollouts through the history index, stepping as a speculative engine would.

For token-id drafts (no draft distribution) vLLM accepts a drafted token with the
target's probability of it, which is exactly the probability that a target sample at
that position equals it. So rollouts sampled from the target (plain vLLM, T=1) replayed
in lockstep, each sequence advancing by its accepted prefix plus one token per step,
give the served acceptance of the history proposer in expectation, without an engine:
seconds per setting instead of minutes. Used to choose the knobs' defaults and, in the
tests, as the estimate that vLLM's counters must agree with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_specrl.proposer.history_index import HistoryConfig, HistoryIndex


@dataclass
class ReplayCounts:
    """The same quantities as vLLM's ``vllm:spec_decode_*`` counters."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    accepted_per_pos: list[int] | None = None
    steps: int = 0
    tokens: int = 0

    def summary(self) -> dict:
        accepted = sum(self.accepted_per_pos or [])
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": accepted, "steps": self.steps, "tokens": self.tokens,
                "acceptance_length": 1 + accepted / self.num_drafts if self.num_drafts else None,
                "per_position_acceptance": [a / self.num_drafts for a in (self.accepted_per_pos or [])]
                if self.num_drafts else [],
                "tokens_per_step": self.tokens / self.steps if self.steps else None}


def replay_epoch(index: HistoryIndex, batch: list[tuple[list[int], list[int], str]], k: int,
                 counts: ReplayCounts) -> None:
    """One batch of requests (prompt ids, completion ids, request id) in flight together, to the end."""
    live = []
    for prompt, completion, rid in batch:
        key, _ = index.group(np.asarray(prompt, dtype=np.int32))
        live.append({"key": key, "prompt": list(prompt), "completion": list(completion), "done": 1, "rid": rid})
    counts.accepted_per_pos = counts.accepted_per_pos or [0] * k
    while any(r["done"] < len(r["completion"]) for r in live):
        counts.steps += 1
        by_group: dict[str, list[dict]] = {}
        for r in live:
            by_group.setdefault(r["key"], []).append(r)
        drafts = {}
        for key, rows in by_group.items():
            out = index.draft_group(key, np.asarray(rows[0]["prompt"], dtype=np.int32),
                                    [np.asarray(r["prompt"] + r["completion"][:r["done"]], dtype=np.int32)
                                     for r in rows],
                                    [k if r["done"] < len(r["completion"]) else 0 for r in rows])
            drafts.update({id(r): d.tokens for r, d in zip(rows, out)})
        for r in live:
            if r["done"] >= len(r["completion"]):
                continue
            draft = drafts.get(id(r), [])
            truth = r["completion"][r["done"]:]
            accepted = 0
            while accepted < len(draft) and accepted < len(truth) and draft[accepted] == truth[accepted]:
                accepted += 1
            if draft:
                counts.num_drafts += 1
                counts.num_draft_tokens += len(draft)
                for j in range(accepted):
                    counts.accepted_per_pos[j] += 1
            step_tokens = min(accepted + 1, len(truth))
            r["done"] += step_tokens
            counts.tokens += step_tokens
    for r in live:
        index.add_completion(r["key"], np.asarray(r["completion"], dtype=np.int32), index.policy_version, r["rid"])


def replay(epochs: list[list[tuple[list[int], list[int]]]], k: int, config: HistoryConfig | None = None,
           versions: list[int] | None = None) -> dict:
    """Replay epochs of (prompt ids, completion ids) batches; ``versions[e]``: epoch e's policy version.
    Returns vLLM-style counters per epoch and in total."""
    index = HistoryIndex(config)
    total = ReplayCounts(accepted_per_pos=[0] * k)
    per_epoch = []
    for e, batch in enumerate(epochs):
        if versions is not None:
            index.set_policy_version(versions[e])
        counts = ReplayCounts(accepted_per_pos=[0] * k)
        replay_epoch(index, [(p, c, f"e{e}-{i}") for i, (p, c) in enumerate(batch)], k, counts)
        per_epoch.append(counts.summary())
        total.num_drafts += counts.num_drafts
        total.num_draft_tokens += counts.num_draft_tokens
        total.steps += counts.steps
        total.tokens += counts.tokens
        total.accepted_per_pos = [a + b for a, b in zip(total.accepted_per_pos, counts.accepted_per_pos)]
    return {"epochs": per_epoch, "total": total.summary()}
