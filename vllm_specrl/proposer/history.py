"""The rollout-history proposer, served through vLLM's ``custom_class`` method.

``--speculative-config '{"method": "custom_class",
"model": "vllm_specrl.proposer.history.HistoryProposer", "num_speculative_tokens": K}'``
(knobs: ``--additional-config '{"specrl": {"history": {...}}}'``, ``HistoryConfig``).

Drafts come from the request's prompt group: siblings in flight (a GRPO group),
earlier rollouts of the same prompt kept across requests (earlier epochs), and the
request's own prompt and output (``history_index``). Drafting is a look-up, no model
forward, but every drafted token is a row the target verifies: with ``cost_aware`` (default) a
token is drafted only if its estimated chance of acceptance beats what a row costs at this
batch size, from a fit of the engine's own step times (``step_cost``); otherwise the fixed
``min_confidence``. For requests sampled at T > 0 each draft token is sampled from the
continuations' shares, and those shares go to vLLM's rejection sampler as the draft
distribution (``take_last_draft_probs``, handed over by ``proposer.custom_binding``):
it accepts with ``min(1, p / q)`` and resamples the rest from ``max(p - q, 0)``, so
the output distribution is the target's. Greedy requests get the heaviest tokens
(token-id drafts).

vLLM hands a ``custom_class`` proposer the batch's token rows; the request ids, prompt
lengths and the step's k (adaptive k) come from the runner through
``custom_binding.install_custom_proposer_binding`` (installed by the plugin). A policy
update (the sync path's commit) ages the history (``on_policy_version``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_specrl.proposer.history_index import Draft, HistoryConfig, HistoryIndex
from vllm_specrl.proposer.step_cost import StepCostModel

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a request at a temperature below it is greedy


@dataclass
class _Live:
    key: str
    prompt_len: int
    version: int
    completion: np.ndarray | None = None   # a copy: the runner reuses rows once a request leaves


class HistoryProposer:
    """A ``custom_class`` proposer: suffix matches over the request's prompt group."""

    def __init__(self, vllm_config: Any):
        from vllm_specrl.compat import engine_config

        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        raw = engine_config.specrl_additional_config(vllm_config).get("history")
        self.index = HistoryIndex(HistoryConfig.from_dict(raw))
        self.live: dict[str, _Live] = {}
        self.input_batch: Any = None
        self.k_limit: int | None = None
        self.steps = 0
        self.propose_seconds = 0.0   # this proposer's own time (look-ups, draft distributions)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        seed = getattr(vllm_config.model_config, "seed", None)
        self.rng = np.random.default_rng(0 if seed is None else int(seed))
        self.last_draft_probs: Any = None
        self.step_cost = StepCostModel()
        self._last_call: float | None = None
        self._last_drafts: dict[str, int] = {}   # request id -> tokens drafted for it at the last step

    # --- vLLM's proposer interface --------------------------------------------------

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the history is built from what the engine generates."""

    def bind_step(self, input_batch: Any, k_limit: int | None) -> None:
        """The runner's batch (request ids, prompt lengths) and this step's k, before ``propose``."""
        self.input_batch, self.k_limit = input_batch, k_limit

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        """Drafts for every row of the batch (an empty list: no draft for that row)."""
        start = time.perf_counter()
        try:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, start)
        finally:
            self.propose_seconds += time.perf_counter() - start

    def _propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                 token_ids_cpu: np.ndarray, now: float) -> list[list[int]]:
        batch = self.input_batch
        if batch is None:
            raise RuntimeError("HistoryProposer needs the vllm-specrl plugin's runner binding "
                               "(VLLM_PLUGINS must include 'specrl'): it reads request ids from the runner")
        self.steps += 1
        num_rows = len(sampled_token_ids)
        req_ids = list(batch.req_ids[:num_rows])
        prompt_lens = batch.num_prompt_tokens[:num_rows]
        joined = self._sync_live(req_ids, prompt_lens, num_tokens_no_spec, token_ids_cpu)
        self._observe_step(now, req_ids, sampled_token_ids, joined)
        k = self.k if self.k_limit is None else min(self.k, self.k_limit)
        drafts: list[Draft] = [Draft([]) for _ in range(num_rows)]
        self.last_draft_probs = None
        self._last_drafts = {}
        if k <= 0:
            return [[] for _ in range(num_rows)]
        threshold = self.step_cost.threshold(num_rows) if self.index.cfg.cost_aware else None
        sample = self.index.cfg.sample_drafts
        temperatures = getattr(batch, "temperature_cpu", None)
        rows_by_group: dict[str, list[int]] = {}
        for row, rid in enumerate(req_ids):
            rows_by_group.setdefault(self.live[rid].key, []).append(row)
        for key, rows in rows_by_group.items():
            lengths = [int(num_tokens_no_spec[row]) for row in rows]
            limits = [min(k, self.max_model_len - n - 1) if sampled_token_ids[row] and n < self.max_model_len else 0
                      for row, n in zip(rows, lengths)]
            rngs = [self.rng if sample and temperatures is not None and temperatures[row] >= GREEDY_EPS else None
                    for row in rows]
            out = self.index.draft_group(key, token_ids_cpu[rows[0], :int(prompt_lens[rows[0]])],
                                         [token_ids_cpu[row, :n] for row, n in zip(rows, lengths)], limits, rngs,
                                         min_confidence=threshold)
            for row, draft in zip(rows, out):
                drafts[row] = draft
        self._last_drafts = {rid: len(d.tokens) for rid, d in zip(req_ids, drafts) if d.tokens}
        if any(d.dists for d in drafts):
            self.last_draft_probs = self._dense_probs(drafts, k)
        return [d.tokens for d in drafts]

    def _dense_probs(self, drafts: list[Draft], k: int) -> Any:
        """``[rows, k, vocab]`` draft distributions as vLLM's rejection sampler reads them: a sampled
        draft's shares per position, one-hot for a token-id draft (what vLLM assumes without any)."""
        import torch

        probs = torch.zeros(len(drafts), k, self.vocab_size, dtype=torch.float32)
        for row, draft in enumerate(drafts):
            if draft.dists:
                for j, (ids, q) in enumerate(draft.dists):
                    probs[row, j, torch.from_numpy(ids)] = torch.from_numpy(q.astype(np.float32))
            else:
                for j, token in enumerate(draft.tokens):
                    probs[row, j, token] = 1.0
        return probs

    def take_last_draft_probs(self) -> Any:
        """The last ``propose``'s draft distributions (None: token-id drafts only), handed to vLLM's
        rejection sampler by ``custom_binding.install_custom_proposer_binding``."""
        probs, self.last_draft_probs = self.last_draft_probs, None
        return probs

    def _observe_step(self, now: float, req_ids: list[str], sampled_token_ids: list[list[int]],
                      joined: bool) -> None:
        """The step that just ran, for the cost fit: its wall time since the last call and its rows
        (a row per sequence plus the drafts it verified). A step in which a request joined or a
        prompt chunk ran (no sampled token) is not a decode step's cost: left out."""
        last, self._last_call = self._last_call, now
        if last is None or joined or not all(sampled_token_ids):
            return
        verified = sum(self._last_drafts.get(r, 0) for r in req_ids)
        self.step_cost.observe(len(req_ids), len(req_ids) + verified, verified > 0, now - last)

    # --- live requests ----------------------------------------------------------------

    def _sync_live(self, req_ids: list[str], prompt_lens: np.ndarray, num_tokens: np.ndarray,
                   token_ids_cpu: np.ndarray) -> bool:
        """Register new requests; keep the completions of those that left the batch. True if a
        request joined (it was not in the last call's batch: every one that left is retired here)."""
        joined = False
        current = set(req_ids)
        for rid in [r for r in self.live if r not in current]:
            self._retire(rid)
        for row, rid in enumerate(req_ids):
            entry = self.live.get(rid)
            if entry is None:
                plen = int(prompt_lens[row])
                key, _ = self.index.group(token_ids_cpu[row, :plen])
                self.index.forget_request(key, rid)
                self.live[rid] = entry = _Live(key, plen, self.index.policy_version)
                joined = True
            entry.completion = np.array(token_ids_cpu[row, entry.prompt_len:int(num_tokens[row])], dtype=np.int32)
        return joined

    def _retire(self, rid: str) -> None:
        entry = self.live.pop(rid)
        if entry.completion is not None and len(entry.completion) and entry.key in self.index.groups:
            self.index.add_completion(entry.key, entry.completion, entry.version, rid)

    def retire(self, request_ids: set[str]) -> None:
        """Requests that finished: their completions join the history now (a speculator told of them,
        Model Runner V2's ``on_requests_finished``), not at the next call."""
        for rid in request_ids:
            if rid in self.live:
                self._retire(rid)

    def reset(self) -> None:
        """Forget every request and completion (Model Runner V2 calls it after its warm-up requests)."""
        self.live.clear()
        self._last_drafts = {}
        version, self.index = self.index.policy_version, HistoryIndex(self.index.cfg)
        self.index.policy_version = version

    # --- vllm-specrl hooks ------------------------------------------------------------

    def on_policy_version(self, version: int) -> None:
        """Called by the worker when a policy update commits: the history ages by one version."""
        self.index.set_policy_version(version)

    def specrl_status(self) -> dict:
        return {"proposer": "history", "k": self.k, "live_requests": len(self.live), "steps": self.steps,
                "propose_ms_per_step": 1e3 * self.propose_seconds / max(self.steps, 1),
                **self.index.status(), "step_cost": self.step_cost.status()}
