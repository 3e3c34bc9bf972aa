"""Rollout history per prompt, and drafts read from it: what the history proposer knows.

RL rollouts repeat. A GRPO step samples G completions of one prompt at once, and the
same prompts come back every epoch, sampled from a policy that moved a little. So the
likeliest continuation of a sequence's suffix is very often written already: in a
sibling that is a few tokens ahead, or in last epoch's rollout of the same prompt.

One ``PromptGroup`` per prompt (keyed by a hash of its token ids) holds the prompt
and the finished completions of that prompt (each with the policy version it was
sampled under). Live sequences are read from the engine's own token rows each step.
A draft for a sequence is found by suffix matching over one corpus per group (the
prompt, every live sibling, every kept completion, each completion preceded by the
prompt's last tokens so a match can run across the prompt/answer boundary):

* the longest suffix of the sequence (``min_match`` .. ``max_match`` tokens) that
  occurs in the corpus gives a set of occurrences, each weighted by its source's
  policy age (``age_decay ** versions_behind``; older than ``max_age`` versions: gone);
* the draft walks the continuations of those occurrences one token at a time, keeping
  only the occurrences that agree with the token drafted. For a request sampled at
  T > 0 (``sample_drafts``), the token is *sampled* from the continuations' weighted
  shares q, and q goes to vLLM as the draft distribution: the rejection sampler then
  accepts with ``sum min(p, q)`` instead of the target's probability of one fixed
  token. Where siblings that share the context went different ways, q is a small
  sample of the target's own distribution there, so this is where the gain is (a
  deterministic draft of the heaviest token is accepted with ``p(top)`` only). Greedy
  requests draft the heaviest token. A token's chance of acceptance is estimated with
  one pseudo-count against the continuations (the heaviest token's share; sampled: the
  plug-in ``sum min(p, q)`` with p the smoothed shares, ``W / (W + 1)``) times m / (m + 1)
  for a match of m tokens (long matches are accepted far more often; calibrated by
  replaying rollouts, ``history_replay``); drafting stops when the chained estimate
  falls below ``min_confidence``, so the draft length per request comes from the data.

Memory is bounded: groups are kept in LRU order and the oldest are dropped beyond
``max_bytes`` (token arrays are int32) or ``max_prompts``; each group keeps its
``max_sequences`` newest completions. Nothing here touches vLLM.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import numpy as np

SEPARATOR = -1
# Fixed cost per kept completion besides its tokens (array header, list slot, metadata),
# measured with tracemalloc (tests/proposer/test_history_index.py checks the accounting).
SEQUENCE_OVERHEAD_BYTES = 256


@dataclass
class HistoryConfig:
    """Knobs: ``--additional-config '{"specrl": {"history": {...}}}'``."""

    max_bytes: int = 64 << 20      # all groups' token arrays together
    max_prompts: int = 4096        # groups kept (LRU by prompt)
    max_sequences: int = 64        # completions kept per prompt (newest first)
    min_match: int = 2             # shortest suffix match that may draft
    max_match: int = 16            # longest suffix compared
    min_confidence: float = 0.25   # draft while the estimated chance that every token so far is accepted
                                   # is at least this: without cost_aware, and until its fit is ready
    cost_aware: bool = True        # the threshold per batch size from the engine's measured step cost
                                   # (a row's cost against a plain step's per sequence: step_cost)
    age_decay: float = 0.5         # weight of a completion per policy version it is behind
    max_age: int = 3               # completions more versions behind than this are dropped
    prompt_tail: int = 16          # prompt tokens kept in front of each completion
    sample_drafts: bool = True     # T > 0: sample each draft token from the continuations' shares and
                                   # hand vLLM those shares as the draft distribution (False: the heaviest
                                   # token, a token-id draft)

    @classmethod
    def from_dict(cls, raw: dict | None) -> "HistoryConfig":
        raw = raw or {}
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown history keys {sorted(unknown)}; known: {sorted(known)}")
        cfg = cls(**raw)
        if not 1 <= cfg.min_match <= cfg.max_match:
            raise ValueError(f"history: need 1 <= min_match <= max_match, got {cfg.min_match}, {cfg.max_match}")
        if not 0.0 < cfg.min_confidence <= 1.0 or not 0.0 <= cfg.age_decay <= 1.0:
            raise ValueError("history: min_confidence must be in (0, 1] and age_decay in [0, 1]")
        return cfg


class Draft(NamedTuple):
    """A draft's tokens and, when sampled, the distribution each was drawn from: per position the
    candidate token ids and their probabilities (None: a token-id draft, one-hot)."""

    tokens: list[int]
    dists: list[tuple[np.ndarray, np.ndarray]] | None = None


NO_DRAFT = Draft([])


def prompt_key(prompt_token_ids: np.ndarray) -> str:
    """A short stable key for a prompt's token ids."""
    return hashlib.blake2b(np.ascontiguousarray(prompt_token_ids, dtype=np.int32).tobytes(),
                           digest_size=8).hexdigest()


@dataclass
class Completion:
    tokens: np.ndarray        # prompt tail + completion, int32
    version: int              # policy version it was sampled under (the oldest, if it spanned an update)
    request_id: str

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + SEQUENCE_OVERHEAD_BYTES


@dataclass
class PromptGroup:
    prompt: np.ndarray
    completions: list[Completion] = field(default_factory=list)
    _corpus: tuple[np.ndarray, np.ndarray] | None = None   # kept completions, concatenated, with versions

    @property
    def nbytes(self) -> int:
        return self.prompt.nbytes + SEQUENCE_OVERHEAD_BYTES + sum(c.nbytes for c in self.completions)

    def kept_corpus(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, version per token) of the kept completions, separated; cached until they change."""
        if self._corpus is None:
            parts, versions = [], []
            for c in self.completions:
                parts.append(c.tokens)
                parts.append(np.array([SEPARATOR], dtype=np.int32))
                versions.append(np.full(len(c.tokens) + 1, c.version, dtype=np.int64))
            self._corpus = ((np.concatenate(parts), np.concatenate(versions)) if parts
                            else (np.empty(0, np.int32), np.empty(0, np.int64)))
        return self._corpus

    def invalidate(self) -> None:
        self._corpus = None


class HistoryIndex:
    """Per-prompt rollout history and the drafts it proposes (see the module docstring)."""

    def __init__(self, config: HistoryConfig | None = None):
        self.cfg = config or HistoryConfig()
        self.groups: OrderedDict[str, PromptGroup] = OrderedDict()
        self.policy_version = 0
        self.nbytes = 0
        self.counts = {"completions_added": 0, "completions_aged_out": 0, "groups_evicted": 0,
                       "completions_evicted": 0, "drafts": 0, "draft_tokens": 0, "sampled_drafts": 0}

    # --- history ------------------------------------------------------------------

    def group(self, prompt_token_ids: np.ndarray) -> tuple[str, PromptGroup]:
        """The group of a prompt (created empty if new), marked most recently used."""
        key = prompt_key(prompt_token_ids)
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = PromptGroup(np.array(prompt_token_ids, dtype=np.int32))
            self.nbytes += g.nbytes
            self._enforce_caps(keep=key)
        else:
            self.groups.move_to_end(key)
        return key, g

    def add_completion(self, key: str, completion_token_ids: np.ndarray, version: int, request_id: str) -> None:
        """Keep a finished completion of the prompt ``key`` (its prompt tail is prepended here)."""
        g = self.groups.get(key)
        if g is None or len(completion_token_ids) == 0:
            return
        self.forget_request(key, request_id)
        tail = g.prompt[-self.cfg.prompt_tail:] if self.cfg.prompt_tail else g.prompt[:0]
        c = Completion(np.concatenate([tail, np.asarray(completion_token_ids, dtype=np.int32)]), int(version),
                       request_id)
        g.completions.append(c)
        self.nbytes += c.nbytes
        self.counts["completions_added"] += 1
        while len(g.completions) > self.cfg.max_sequences:
            self.nbytes -= g.completions.pop(0).nbytes
            self.counts["completions_evicted"] += 1
        g.invalidate()
        self.groups.move_to_end(key)
        self._enforce_caps(keep=key)

    def forget_request(self, key: str, request_id: str) -> None:
        """Drop a kept completion of ``request_id`` (a preempted request that came back is live again)."""
        g = self.groups.get(key)
        if g is None:
            return
        kept = [c for c in g.completions if c.request_id != request_id]
        if len(kept) != len(g.completions):
            self.nbytes -= sum(c.nbytes for c in g.completions if c.request_id == request_id)
            g.completions = kept
            g.invalidate()

    def set_policy_version(self, version: int) -> None:
        """A policy update: completions now count as older; those beyond ``max_age`` go."""
        self.policy_version = int(version)
        for g in self.groups.values():
            kept = [c for c in g.completions if self.policy_version - c.version <= self.cfg.max_age]
            if len(kept) != len(g.completions):
                self.counts["completions_aged_out"] += len(g.completions) - len(kept)
                self.nbytes -= sum(c.nbytes for c in g.completions) - sum(c.nbytes for c in kept)
                g.completions = kept
                g.invalidate()

    def _enforce_caps(self, keep: str) -> None:
        """Drop least recently used groups, then ``keep``'s oldest rollouts, until under the caps.
        ``keep`` was just used, so it is last in LRU order: the loop stops before reaching it."""
        while len(self.groups) > 1 and (self.nbytes > self.cfg.max_bytes or len(self.groups) > self.cfg.max_prompts):
            self.nbytes -= self.groups.popitem(last=False)[1].nbytes
            self.counts["groups_evicted"] += 1
        g = self.groups.get(keep)
        while g is not None and self.nbytes > self.cfg.max_bytes and g.completions:
            self.nbytes -= g.completions.pop(0).nbytes
            self.counts["completions_evicted"] += 1
            g.invalidate()

    # --- drafting -----------------------------------------------------------------

    def corpus(self, key: str, live: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, weight per token) to match in: the prompt, the live sequences (prompt tail +
        completion so far, the drafting sequence's own included) and the kept completions."""
        g = self.groups[key]
        kept, versions = g.kept_corpus()
        sep = np.array([SEPARATOR], dtype=np.int32)
        parts = [g.prompt, sep]
        for seq in live:
            parts += [seq, sep]
        live_len = sum(len(p) for p in parts)
        tokens = np.concatenate(parts + [kept])
        weights = np.empty(len(tokens), dtype=np.float64)
        weights[:live_len] = 1.0
        if len(kept):
            weights[live_len:] = self.cfg.age_decay ** np.maximum(self.policy_version - versions, 0)
        return tokens, weights

    def draft_group(self, key: str, prompt: np.ndarray, sequences: list[np.ndarray],
                    max_tokens: list[int], rngs: list[np.random.Generator | None] | None = None,
                    min_confidence: float | None = None) -> list[Draft]:
        """Drafts for the live sequences of one prompt (each its full token ids, prompt first; each
        drafts from its own text, its siblings' and the kept rollouts); ``max_tokens[i]`` 0: none;
        ``rngs[i]``: sample sequence i's draft (None: the heaviest tokens); ``min_confidence``: this
        step's threshold (None: the configured one). The one drafting path of both the proposer and
        the replay."""
        if key not in self.groups:  # evicted under the memory cap while in flight
            self.group(prompt)
        tail_start = max(len(prompt) - self.cfg.prompt_tail, 0)
        corpus = self.corpus(key, [np.asarray(seq[tail_start:], dtype=np.int32) for seq in sequences])
        rngs = rngs or [None] * len(sequences)
        return [self.draft(corpus, seq[-self.cfg.max_match:], m, rng, min_confidence) if m > 0 else NO_DRAFT
                for seq, m, rng in zip(sequences, max_tokens, rngs)]

    def draft(self, corpus: tuple[np.ndarray, np.ndarray], context: np.ndarray, max_tokens: int,
              rng: np.random.Generator | None = None, min_confidence: float | None = None) -> Draft:
        """The draft for a sequence ending in ``context`` (its last tokens), at most ``max_tokens``
        long; with ``rng``, each token sampled from the continuations' shares (``Draft.dists``)."""
        tokens, weights = corpus
        threshold = self.cfg.min_confidence if min_confidence is None else min_confidence
        found = self._suffix_occurrences(tokens, context) if max_tokens > 0 else None
        if found is None:
            return NO_DRAFT
        cand, matched = found
        out: list[int] = []
        dists: list[tuple[np.ndarray, np.ndarray]] = []
        confidence = 1.0
        for d in range(max_tokens):
            step = self._continuations(tokens, weights, cand, d)
            if step is None:
                break
            cand_live, uniq, inverse, mass = step
            total = mass.sum()
            # Estimated chance this token is accepted given the ones before were: the continuations'
            # share with one pseudo-count against them, times m / (m + 1) for a match of m tokens (the
            # draft so far extends the match). Token-id drafts: the heaviest token's share (calibrated on
            # replayed rollouts: docs/history-proposer.md). Sampled drafts: sum min(p, q) with p the
            # smoothed shares.
            m = matched + d
            if rng is None:
                pick = int(np.argmax(mass))
                share = mass[pick] / (total + 1.0)
            else:
                q = mass / total
                pick = int(min(np.searchsorted(np.cumsum(q), rng.random() * q.sum(), side="right"), len(q) - 1))
                share = total / (total + 1.0)
            confidence *= m / (m + 1.0) * share
            if confidence < threshold:
                break
            out.append(int(uniq[pick]))
            if rng is not None:
                dists.append((uniq.astype(np.int64), q))
            cand = cand_live[inverse == pick]
        if out:
            self.counts["drafts"] += 1
            self.counts["draft_tokens"] += len(out)
            if rng is not None:
                self.counts["sampled_drafts"] += 1
        return Draft(out, dists if rng is not None else None)

    def shares_along(self, corpus: tuple[np.ndarray, np.ndarray], context: np.ndarray,
                     continuation: np.ndarray, max_tokens: int,
                     min_confidence: float | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """The sampled draft's distributions (ids, q) per step when its draws were ``continuation``'s
        tokens: what the rejection sampler sees while the draft is being accepted. It ends at the
        step where the draft stops, or after the first step whose draw cannot be the continuation's
        token (q of it is 0: that step is rejected whatever was drawn). For estimates from rollouts
        (``min(1, q(x) / p(x))`` per step); counts nothing."""
        tokens, weights = corpus
        threshold = self.cfg.min_confidence if min_confidence is None else min_confidence
        found = self._suffix_occurrences(tokens, context) if max_tokens > 0 else None
        if found is None:
            return []
        cand, matched = found
        dists: list[tuple[np.ndarray, np.ndarray]] = []
        confidence = 1.0
        for d in range(min(max_tokens, len(continuation))):
            step = self._continuations(tokens, weights, cand, d)
            if step is None:
                break
            cand_live, uniq, inverse, mass = step
            total = mass.sum()
            confidence *= (matched + d) / (matched + d + 1.0) * total / (total + 1.0)
            if confidence < threshold:
                break
            dists.append((uniq.astype(np.int64), mass / total))
            hit = np.flatnonzero(uniq == continuation[d])
            if not len(hit):
                break
            cand = cand_live[inverse == int(hit[0])]
        return dists

    def _suffix_occurrences(self, tokens: np.ndarray, context: np.ndarray) -> tuple[np.ndarray, int] | None:
        """Positions where the longest suffix of ``context`` (``min_match``..``max_match`` tokens) ends
        in the corpus with a continuation token after it, and that suffix's length; None: no match."""
        cfg = self.cfg
        if len(context) < cfg.min_match or len(tokens) < 2:
            return None
        # Occurrences p of the suffix with a continuation token at p + 1 (which also leaves out
        # the drafting sequence's own end: it matches its own suffix in full and continues nowhere).
        cand = np.flatnonzero((tokens[:-1] == context[-1]) & (tokens[1:] != SEPARATOR))
        matched = 1
        for j in range(1, min(cfg.max_match, len(context))):
            prev = cand - j
            ok = prev >= 0
            longer = cand[ok][tokens[prev[ok]] == context[-1 - j]]
            if not len(longer):
                break
            cand, matched = longer, j + 1
        if matched < cfg.min_match or not len(cand):
            return None
        return cand, matched

    @staticmethod
    def _continuations(tokens: np.ndarray, weights: np.ndarray, cand: np.ndarray, d: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """The tokens ``d + 1`` after each occurrence: (occurrences that continue, distinct next tokens,
        each occurrence's index into them, each token's weighted mass); None: no occurrence continues."""
        pos = cand + 1 + d
        pos = pos[pos < len(tokens)]
        nxt = tokens[pos]
        live = nxt != SEPARATOR
        if not live.any():
            return None
        cand_live, nxt = pos[live] - 1 - d, nxt[live]
        uniq, inverse = np.unique(nxt, return_inverse=True)
        return cand_live, uniq, inverse, np.bincount(inverse, weights=weights[cand_live])

    def status(self) -> dict:
        """For /specrl/status: size against the caps, ages, what was drafted."""
        return {"prompts": len(self.groups), "completions": sum(len(g.completions) for g in self.groups.values()),
                "bytes": self.nbytes, "max_bytes": self.cfg.max_bytes, "max_prompts": self.cfg.max_prompts,
                "policy_version": self.policy_version, "config": {f.name: getattr(self.cfg, f.name)
                                                                  for f in fields(self.cfg)},
                **self.counts}
