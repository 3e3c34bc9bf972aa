"""Choose k (drafts per step, 0 included) that maximises expected tokens per second, per batch-size
bucket, from the estimates of ``estimators`` kept current from the engine's own steps.

Contract: ``k_for(batch)`` is the k to draft at that batch size; ``observe_step`` feeds every step back;
nothing here changes what is sampled, only how many drafts are verified. How the choice is made (bursts,
margins, the monotone cost envelope, calibration at start-up) and why: docs/adaptive-k.md, "How the
controller chooses k".
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from vllm_specrl.adaptive.estimators import AcceptanceTracker, RelativeCost, batch_bucket, bucket_bounds

# Steady steps of the served k without verified drafts between two choices of a bucket (see observe_step).
RECHOOSE_EVERY = 8


@dataclass
class AdaptiveKConfig:
    """Knobs (``--additional-config '{"specrl": {"adaptive_k": {...}}}'``)."""

    burst: int = 9                 # steps run at a k being measured (the first is not counted)
    min_samples: int = 24          # steady steps per (bucket, k) before the bucket is trusted: single
                                   # CPU steps jitter by 15-20%, k's differ by 5-15%
    explore_first: int = 16        # steps of a bucket before its first burst at a neighbour of its best
    explore_every: int = 256       # ... the gap doubles after each burst, up to this
    explore_max: int = 2048        # ... and on up to this while no neighbour of the served k could pay
                                   # (``elimination_z`` standard errors in its favour): a burst costs
                                   # more than its k's steps there, it makes the drafter catch up on
                                   # every held row (see ``_exploration_due``)
    cost_window: int = 48          # ratio samples per (bucket, k) the estimate is the median of
    decay: float = 0.998           # per-sample decay of each position's acceptance counts
    prior_accept: float = 0.5      # prior conditional acceptance of a position with no data
    prior_weight: float = 2.0      # its weight, in drafts
    optimism: float = 1.0          # standard errors added to each position's acceptance when choosing
    optimism_where_paying: bool = True  # ... only for a k that beats k = 0 at the mean acceptance
    share_calibration: bool = True  # a new bucket starts at a calibrated neighbour's k and climbs
    switch_margin: float = 0.02    # a larger k than a served k > 0 must promise this much more throughput
                                   # (plus the standard error of its measured cost ratio) to be served instead
    speculate_margin: float = 0.05  # a k > 0 is valued as if its step cost this much more than measured,
                                   # in every comparison with k = 0 (what step timing does not see:
                                   # prefills and k switches; the sweep's own noise at large batches)
    sweep_samples: int = 16        # steady steps per (bucket, k) a start-up calibration sweep measures
    elimination_z: float = 2.0     # while calibrating, a k whose throughput at z standard errors in its
                                   # favour (acceptance and cost) is below another's at z against stops
                                   # being measured; 0: measure every k to min_samples

    @classmethod
    def from_dict(cls, raw: dict | bool | None) -> "AdaptiveKConfig":
        if not isinstance(raw, dict):
            return cls()
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown adaptive_k keys {sorted(unknown)}; "
                             f"known: {sorted(cls.__dataclass_fields__)}")
        return cls(**raw)


@dataclass
class _Bucket:
    cost: RelativeCost
    calibrated: bool = False
    burst_k: int | None = None
    burst_left: int = 0
    steps_since_burst: int = 0
    explore_gap: int = 16
    inherited: bool = False  # started at a neighbour's k (never a donor itself)
    swept: bool = False      # every k measured by a start-up calibration sweep
    hopeless_checked_at: int = -1  # steps_since_burst when the neighbours were last found hopeless
    unchosen_steps: int = 0        # steady steps since the last choice

    @property
    def best(self) -> int:
        return self.cost.served


class AdaptiveKController:
    """The policy: ``lookup_for_step()`` before a schedule, ``record_choice`` and ``observe_step`` after."""

    def __init__(self, max_k: int, max_batch: int, config: AdaptiveKConfig | None = None,
                 choices: tuple[int, ...] | None = None):
        """``choices``: the k's it may serve (default 0..max_k; always 0 and max_k among them). A
        parallel (P-EAGLE) drafter serves only 0 and its configured k: its mask slots are laid out
        for that k, so a step at another k fails (and its one pass costs nearly the same at any k)."""
        self.cfg = config or AdaptiveKConfig()
        self.max_k, self.max_batch = max_k, max_batch
        self.choices = tuple(sorted(set(range(max_k + 1) if choices is None else choices)))
        if self.choices[0] != 0 or self.choices[-1] != max_k:
            raise ValueError(f"adaptive k choices {self.choices} must include 0 and max_k = {max_k}")
        self.acceptance = AcceptanceTracker(max_k, self.cfg.decay, self.cfg.prior_accept,
                                            self.cfg.prior_weight)
        # What each k's step is valued at in a choice: measured, times the hurdle a k > 0 carries.
        self._hurdle = [1.0] + [1.0 + self.cfg.speculate_margin] * max_k
        self.num_buckets = batch_bucket(max_batch) + 1
        self._bucket_of = [batch_bucket(b) for b in range(max_batch + 1)]  # by batch size, every step
        self._last_by_bucket: list[int] = []
        self._last_table: list[int] = []
        # Every bucket starts without speculation (never worse than plain while it measures).
        self.buckets = [_Bucket(RelativeCost(max_k, 0, self.cfg.cost_window), explore_gap=self.cfg.explore_first)
                        for _ in range(self.num_buckets)]
        self.steps = 0
        self.steady_steps = 0
        self.explored_steps = 0
        self.calibration_steps = 0
        self.chosen_counts = [0] * (max_k + 1)
        self.last_choice = 0
        self.overheads: deque[float] = deque(maxlen=256)  # seconds of each interval outside the runner
        self._overhead_sum = 0.0
        self._overhead_mean = float("nan")

    # --- choice ---------------------------------------------------------------------

    def _next_burst(self, bucket: int, calibrating: bool = False) -> int | None:
        """The k a bucket should measure next, or None to serve its best (and refresh the reference)."""
        state = self.buckets[bucket]
        if state.cost.samples(state.best) < 3:
            return None  # a burst needs a fresh reference just before it
        if calibrating:
            if state.swept or state.steps_since_burst < 3:
                return None  # each burst right after a few steps of the served k: a fresh reference
            missing = [k for k in self.choices
                       if k != state.best and state.cost.samples(k) < self.cfg.sweep_samples]
            if missing:
                self._restart_clock(state)
                return min(missing, key=lambda k: (state.cost.samples(k), k))
            state.calibrated, state.inherited, state.swept = True, False, True
            self._choose(bucket)
            return None
        if not state.calibrated:
            missing = [k for k in self.choices
                       if k != state.best and state.cost.samples(k) < self.cfg.min_samples
                       and not self._cannot_pay(state, k)]
            if missing:
                return min(missing, key=lambda k: (state.cost.samples(k), k))
            state.calibrated = True
            self._choose(bucket)
            return None
        if self._exploration_due(state):
            self._restart_clock(state)
            state.explore_gap = min(2 * state.explore_gap, max(self.cfg.explore_every, self.cfg.explore_max))
            return min(self._neighbours(state), key=state.cost.samples)
        return None

    @staticmethod
    def _restart_clock(state: _Bucket) -> None:
        """A burst starts: the bucket counts its steps from 0 again, and a hopeless verdict dated on the
        old count is dropped (kept, it would look newer than every step until the count caught up)."""
        state.steps_since_burst, state.hopeless_checked_at = 0, -1

    def _neighbours(self, state: _Bucket) -> list[int]:
        at = self.choices.index(state.best)
        return [self.choices[i] for i in (at - 1, at + 1) if 0 <= i < len(self.choices)]

    def _exploration_due(self, state: _Bucket) -> bool:
        """A calibrated bucket's next burst is due every ``explore_every`` steps (the gap doubling up
        to it), and only every ``explore_max`` while each neighbour of the served k is hopeless:
        measured, and unable to pay even with its acceptance and cost ``elimination_z`` standard
        errors in its favour (``_cannot_pay``); a burst due by the doubling gap is skipped only
        where acceptance alone rules every neighbour out (``_cannot_pay_at_any_cost``). Acceptance
        is learnt from every bucket's drafts, so a draft that gets better (online training) makes a
        neighbour hopeful again and the burst comes at the usual gap. Why: where no k pays (large
        batches on a CPU, a small fast model) every burst costs steps that return less than they
        cost, and each one makes the deferred drafter replay every held row of the batch (the
        draft-KV upkeep the deferral saves)."""
        gone = state.steps_since_burst
        if gone >= state.explore_gap:
            # The doubling gaps re-measure costs that a start-up sweep can misjudge by more than their
            # standard errors say: skipped only where acceptance alone rules every neighbour out.
            return gone >= max(self.cfg.explore_every, self.cfg.explore_max) or not self._neighbours_ruled_out(
                state, gone, self._cannot_pay_at_any_cost, since=state.explore_gap)
        return gone >= self.cfg.explore_every and not self._neighbours_ruled_out(state, gone, self._cannot_pay)

    def _neighbours_ruled_out(self, state: _Bucket, gone: int, cannot_pay: Callable[[_Bucket, int], bool],
                              since: int = 0) -> bool:
        """Every neighbour of the served k ruled out by ``cannot_pay``; a verdict made at ``gone >= since``
        holds for ``burst`` steps of the bucket (the estimates move slowly, the check is not free, and a
        bucket not running keeps its verdict without checking again)."""
        if since <= state.hopeless_checked_at and gone - state.hopeless_checked_at < self.cfg.burst:
            return True
        if all(cannot_pay(state, k) for k in self._neighbours(state)):
            state.hopeless_checked_at = gone
            return True
        return False

    def _cannot_pay_at_any_cost(self, state: _Bucket, k: int) -> bool:
        """A k above the served one that could not pay even if its step cost no more than the served
        k's (the least a step that drafts and verifies more can cost), with its acceptance
        ``elimination_z`` standard errors up and the ``speculate_margin`` a k > 0 carries against
        k = 0: a draft that is almost never accepted (a fresh draft, a small fast model where
        nothing pays), whatever the costs measured."""
        if k <= state.best or self.cfg.elimination_z <= 0:
            return False
        high = self.acceptance.expected_tokens(self.cfg.elimination_z)[k]
        low = self.acceptance.expected_tokens(-self.cfg.elimination_z)[state.best]
        return high < low * (1 + self.cfg.speculate_margin if state.best == 0 else 1)

    def _start(self, bucket: int) -> None:
        """Start a bucket from a calibrated one, where there is one to start from. The best k changes
        slowly with batch size, so a bucket next to one calibrated on its own steps starts at that
        bucket's k, trusted at once, and climbs from there with its own bursts at the neighbours of
        the served k, instead of measuring every k first (with natural lengths each wave sweeps
        through every bucket as sequences finish; calibrating each from nothing spent a large share
        of a benchmark's steps at expensive k's).

        Donors: an adjacent bucket that calibrated on its own steps, or else the nearest such bucket
        at a *larger* batch size at any distance (a smaller batch pays at least the k a larger one
        does, so it starts low and climbs; never the reverse: 16 sequences started at the k of 4
        paid steps dearer than plain's until it climbed down). Called at every step of a bucket that has not
        calibrated, so a bucket that first ran before any donor existed (an engine's one-sequence
        warm-up) adopts one when it appears, instead of calibrating from nothing in the few tail
        steps a 4-sequence workload gives it (it served k = 0 there, where k = 3 pays)."""
        state = self.buckets[bucket]
        if not self.cfg.share_calibration:
            return
        own = [i for i, b in enumerate(self.buckets) if b.calibrated and not b.inherited and i != bucket]
        donors = [i for i in own if abs(i - bucket) == 1]
        if not donors:
            above = [i for i in own if i > bucket]
            donors = [min(above)] if above else []
        if not donors:
            return
        donor = self.buckets[max(donors, key=lambda i: (sum(map(len, self.buckets[i].cost.ratios)), i))]
        state.cost = RelativeCost(self.max_k, donor.best, self.cfg.cost_window)
        state.calibrated = state.inherited = True
        state.burst_k, state.burst_left = None, 0

    def k_for_bucket(self, bucket: int, calibrating: bool = False) -> int:
        state = self.buckets[bucket]
        if state.burst_left <= 0:
            state.burst_k = self._next_burst(bucket, calibrating)
            state.burst_left = self.cfg.burst if state.burst_k is not None else 0
        return state.burst_k if state.burst_left > 0 else state.best

    def lookup_for_step(self, calibrating: bool = False) -> list[int]:
        """The batch-size -> k table for the next schedule (index 0 unused); ``calibrating``: the
        batch holds only start-up calibration requests."""
        by_bucket = [self.k_for_bucket(b, calibrating) for b in range(self.num_buckets)]
        if by_bucket != self._last_by_bucket:  # the table changes a few times a run: built only then
            self._last_by_bucket, self._last_table = by_bucket, [by_bucket[bucket] for bucket in self._bucket_of]
        return self._last_table

    def record_choice(self, batch: int, k: int, calibrating: bool = False) -> None:
        """The step vLLM scheduled: ``batch`` requests, ``k`` drafts to propose for the next."""
        self.steps += 1
        bucket = self._bucket_of[min(batch, self.max_batch)]
        state = self.buckets[bucket]
        if calibrating:
            self.calibration_steps += 1
        elif not state.calibrated:
            self._start(bucket)
        if state.burst_left > 0:
            state.burst_left -= 1
            self.explored_steps += not calibrating
        else:
            state.steps_since_burst += 1
        if 0 <= k <= self.max_k:
            self.chosen_counts[k] += 1
        self.last_choice = k

    def k_for(self, batch: int) -> int:
        """The k served at this batch size outside measurement bursts."""
        return self.buckets[self._bucket_of[min(batch, self.max_batch)]].best

    # --- observation -----------------------------------------------------------------

    def observe_step(self, batch: int, k_verify: int, k_draft: int, seconds: float | None,
                     verified: list[tuple[int, int]], runner_seconds: float | None = None,
                     calibrating: bool = False) -> None:
        """A step's output: its shape, its wall time since the previous output (None when it
        was not a clean decode step), the model runner's own time for it where the worker
        timed it, and ``(drafts, accepted)`` per request that verified drafts.

        With the runner's time, k's are compared on it, and the rest of the interval
        (engine loop, output processing: paid by every k alike, and the noisy part) is
        added back as its mean when choosing, so a slow spell outside the runner does
        not read as a slow k. A ``calibrating`` step (start-up sweep) is timed but moves no choice:
        the bucket chooses once its sweep is done."""
        for drafts, accepted in verified:
            self.acceptance.observe(drafts, accepted)
        if seconds is None or seconds <= 0 or k_verify != k_draft or batch < 1:
            return
        if runner_seconds is not None and 0 < runner_seconds <= seconds:
            if len(self.overheads) == self.overheads.maxlen:
                self._overhead_sum -= self.overheads[0]
            self.overheads.append(seconds - runner_seconds)
            self._overhead_sum += seconds - runner_seconds  # a running mean: read for every k of every choice
            self._overhead_mean = self._overhead_sum / len(self.overheads)
            seconds = runner_seconds
        bucket = self._bucket_of[min(batch, self.max_batch)]
        state = self.buckets[bucket]
        state.cost.observe(k_verify, seconds)
        self.steady_steps += 1
        # A step of the served k with no verified drafts moves only the reference time, which every
        # candidate's rate shares: re-choosing then can wait a few steps (a choice runs in the engine
        # core between a small model's steps; benchmarks/JOURNAL.md has its cost).
        state.unchosen_steps += 1
        if (state.calibrated and not calibrating
                and (verified or k_verify != state.best or state.unchosen_steps >= RECHOOSE_EVERY)):
            state.unchosen_steps = 0
            self._choose(bucket)

    def _choose(self, bucket: int) -> None:
        """Serve the k with the most expected tokens per unit of step time, if it beats the served
        one by more than the standard error of its cost ratio, plus ``switch_margin`` for a larger k
        than a served k > 0 (measured ratios are noisy: no flapping on noise); every k > 0 carries the
        ``speculate_margin`` hurdle against k = 0.

        The optimism bonus (``optimism`` standard errors on each position's acceptance) goes only
        to a k that pays at the *mean* estimate, i.e. beats k = 0 without it (``optimism_where_paying``):
        where a k costs more k = 0 steps than it can return tokens at today's acceptance, being
        wrong about it is expensive, so it is not served on hope; bursts at the served k's
        neighbours keep measuring it. (Without this, a bucket calibrated before any real draft, its
        acceptance at the optimistic prior, served large k at large batches until real drafts pulled it
        down.) Where a k is cheap (small batches) the bonus still explores it."""
        state = self.buckets[bucket]
        tokens = self.acceptance.expected_tokens(self.cfg.optimism)
        measured = [state.cost.samples(k) >= min(3, self.cfg.min_samples) for k in range(self.max_k + 1)]
        hurdle = self._hurdle
        ratios = [self._step_ratio(state.cost, k) * hurdle[k] if measured[k] else float("nan")
                  for k in range(self.max_k + 1)]
        if self.cfg.optimism_where_paying and measured[0]:
            mean = self.acceptance.expected_tokens()
            tokens = ([mean[k] if k > 0 and measured[k] and mean[k] / ratios[k] < 1.0 / ratios[0]
                       else tokens[k] for k in range(self.max_k + 1)])
        rates = [tokens[k] / ratios[k] if measured[k] and k in self.choices else -1.0
                 for k in range(self.max_k + 1)]
        rates[state.best] = tokens[state.best] / hurdle[state.best]
        best = max(range(self.max_k + 1), key=rates.__getitem__)  # the first of equals
        # Down needs no margin, only the candidate's own noise: where two k's are that close, the
        # smaller one is the safer (costs a step's timing does not see, prefills and k switches,
        # grow with k; a margin on the way down once held a losing k for a whole run). Up from
        # k = 0 the hurdle already is the margin: k > 0 must beat it by ``speculate_margin``.
        margin = self.cfg.switch_margin if best > state.best > 0 else 0.0
        needed = 1 + margin + state.cost.ratio_stderr(best)
        if best != state.best and rates[best] > rates[state.best] * needed:
            state.cost.serve(best)

    def _cannot_pay(self, state: _Bucket, k: int) -> bool:
        """Successive elimination while a bucket calibrates: after one burst at ``k``, stop measuring
        it if even its optimistic throughput (each position's acceptance ``elimination_z`` standard
        errors up, its cost ratio as many down) is below the pessimistic throughput of a k already
        measured (the served k included). At 16 sequences on a CPU, k = 2 and 3 cost 1.8-2.2 plain
        steps: measured to ``min_samples`` each they were most of a bucket's calibration cost,
        although one burst already shows they cannot pay. Positions with few drafts reached get a
        large optimism bonus, so a k is never dropped for lack of acceptance data."""
        z = self.cfg.elimination_z
        if z <= 0 or state.cost.samples(k) < self.cfg.burst - 1:
            return False
        high, low = self.acceptance.expected_tokens(z), self.acceptance.expected_tokens(-z)

        def rate(j: int, tokens: list[float], sign: float) -> float:
            ratio = state.cost.ratio(j) + sign * z * state.cost.ratio_stderr(j)
            return float(tokens[j] / self._with_outside(state.cost, max(ratio, 1e-6)))

        measured = [j for j in self.choices
                    if j != k and (j == state.best or state.cost.samples(j) >= self.cfg.burst - 1)]
        return rate(k, high, -1.0) < max(rate(j, low, 1.0) for j in measured)

    def _step_ratio(self, cost: RelativeCost, k: int) -> float:
        """A whole step of k against one of the served k (the monotone envelope of the runner
        ratios), plus the time outside the runner (when the runner is timed) that both pay."""
        return self._with_outside(cost, cost.envelope(k))

    def _with_outside(self, cost: RelativeCost, ratio: float) -> float:
        """A runner-time ratio as a whole-step ratio: the time outside the runner is paid by both."""
        served = cost.served_seconds
        if not self.overheads or math.isnan(served):
            return ratio
        outside = self._overhead_mean
        return (ratio * served + outside) / (served + outside)

    def no_k_pays(self) -> bool:
        """True when every bucket that measured its own steps serves k = 0 and no neighbour of it could
        pay even with its acceptance and cost ``elimination_z`` standard errors in its favour, and no
        bucket serves k > 0: the engine then pays a drafter's per-step bookkeeping (target hidden
        states kept, drafter inputs held, the spec-decode bookkeeping of vLLM and of this controller)
        for nothing, a share of the step k = 0 cannot win back, largest on a small, fast model
        (benchmarks/README.md); the user is told (``state()``, the scheduler's log) to serve without speculation or
        with a better draft."""
        own = [b for b in self.buckets if b.calibrated and not b.inherited]
        if not own or any(b.best > 0 for b in self.buckets if b.calibrated):
            return False
        return all(self._cannot_pay(b, k) for b in own for k in self._neighbours(b))

    # --- reporting -------------------------------------------------------------------

    def state(self) -> dict:
        """JSON-safe view for /specrl/status and /metrics."""
        tokens = self.acceptance.expected_tokens()
        return {"max_k": self.max_k, "choices": list(self.choices), "steps": self.steps,
                "steady_steps": self.steady_steps,
                "explored_steps": self.explored_steps, "calibration_steps": self.calibration_steps,
                "last_k": self.last_choice,
                "chosen_k_counts": list(self.chosen_counts),
                "conditional_acceptance": [round(float(c), 4) for c in self.acceptance.conditional()],
                "acceptance_drafts": [round(float(n), 3) for n in self.acceptance.reached],
                "acceptance_accepted": [round(float(n), 3) for n in self.acceptance.accepted],
                "expected_tokens_per_step": [round(float(t), 4) for t in tokens],
                "calibrated": any(b.calibrated for b in self.buckets),
                "no_k_pays": self.no_k_pays(),
                "step_overhead_ms": round(1e3 * self._overhead_mean, 3) if self.overheads else None,
                "buckets": {f"{bucket_bounds(i)[0]}-{min(bucket_bounds(i)[1], self.max_batch)}": {
                    "best_k": b.best, "calibrated": b.calibrated, "from_neighbour": b.inherited,
                    "swept": b.swept,
                    "served_step_ms": None if math.isnan(b.cost.served_seconds)
                    else round(1e3 * b.cost.served_seconds, 3),
                    "step_time_vs_served": [None if math.isnan(b.cost.ratio(k)) else round(b.cost.ratio(k), 4)
                                            for k in range(self.max_k + 1)],
                    "samples": [b.cost.samples(k) for k in range(self.max_k + 1)]}
                    for i, b in enumerate(self.buckets)}}
