"""What the adaptive-k controller estimates from the engine's own steps: the acceptance of each draft
position (``AcceptanceTracker``) and what each k costs relative to the served one (``RelativeCost``), per
batch-size bucket (``batch_bucket``). Plain Python on a handful of numbers: the engine core updates and
reads them on every step."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


def batch_bucket(batch: int) -> int:
    """0 for 1 sequence, 1 for 2, 2 for 3, 3 for 4-5, 4 for 6-7, 5 for 8-11, 6 for 12-15, ...

    Half octaves: on a CPU a verify pass turns from memory-bound to compute-bound between a few rows
    and a few tens, so what k costs changes within an octave. Octave buckets calibrated at their
    lower end served k = 3 to 3 sequences at the cost measured at 2 (12 rows verified, not 8: the
    long tail of a `make demo` step), and k = 1 to a refilled 16-sequence batch whenever it dipped
    to 15 for a step, at the cost measured at 8."""
    b = max(batch, 1)
    octave = b.bit_length() - 1
    if octave == 0:
        return 0
    return 2 * octave - 1 + (b >= 3 << (octave - 1))


def bucket_bounds(bucket: int) -> tuple[int, int]:
    """The smallest and largest batch size of ``bucket`` (``batch_bucket``'s inverse)."""
    if bucket == 0:
        return 1, 1
    octave, upper_half = (bucket + 1) // 2, bucket % 2 == 0
    if upper_half:
        return 3 << (octave - 1), (1 << (octave + 1)) - 1
    return 1 << octave, (3 << (octave - 1)) - 1


@dataclass
class AcceptanceTracker:
    """Decayed per-position counts: drafts that reached position j, and were accepted there.

    Plain Python floats, not numpy: the engine core updates these for every verifying request and
    reads them at every step, on ``max_k`` (a handful of) positions, where numpy's per-call cost is
    most of the work."""

    max_k: int
    decay: float = 0.998
    prior_accept: float = 0.5
    prior_weight: float = 2.0
    reached: list[float] = field(init=False)
    accepted: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.reached = [0.0] * self.max_k
        self.accepted = [0.0] * self.max_k
        self.version = 0  # bumped by every observation: the cached estimates below are for it
        self._cache: dict[float, tuple[int, list[float]]] = {}

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verify: ``num_drafts`` proposed, the first ``num_accepted`` accepted."""
        if num_drafts <= 0:
            return
        reached = min(num_drafts, num_accepted + 1, self.max_k)
        # Decay only the positions this verify reached: each position's estimate covers its own
        # last ~1/(1 - decay) samples, however rarely drafts are that long.
        decay, accepted = self.decay, min(num_accepted, self.max_k)
        for j in range(reached):
            self.reached[j] = self.reached[j] * decay + 1.0
            self.accepted[j] = self.accepted[j] * decay + (j < accepted)
        self.version += 1

    def conditional(self) -> list[float]:
        """Acceptance of position j given positions < j were accepted. The prior of position 0 is
        ``prior_accept``; that of position j > 0 is position j - 1's estimate (later positions
        rarely accept more often than earlier ones), so a position that is never reached because
        the one before it is never accepted does not promise ``prior_accept``."""
        c, prior, weight = [], self.prior_accept, self.prior_weight
        for reached, accepted in zip(self.reached, self.accepted):
            prior = (accepted + prior * weight) / (reached + weight)
            c.append(prior)
        return c

    def expected_tokens(self, optimism: float = 0.0) -> list[float]:
        """``E[tokens per request and step | k]`` for k = 0..max_k; with ``optimism`` z, each
        position's acceptance is raised by z standard errors (few samples: a larger bonus), so
        a position that was unlucky in its first few drafts gets drafted again and measured
        (a negative z: lowered, a pessimistic bound). Cached until the next observation."""
        cached = self._cache.get(optimism)
        if cached is not None and cached[0] == self.version:
            return cached[1]
        tokens, chain = [1.0], 1.0
        for c, reached in zip(self.conditional(), self.reached):
            if optimism:
                c = min(max(c + optimism * math.sqrt(c * (1 - c) / (reached + self.prior_weight)), 0.0), 1.0)
            chain *= c
            tokens.append(tokens[-1] + chain)
        self._cache[optimism] = (self.version, tokens)
        return tokens


class RelativeCost:
    """Step time of each k relative to the k being served, per batch bucket, measured in pairs.

    Absolute step times drift within a rollout (attention over a growing context makes a
    step slower token by token), so a k measured early
    cannot be compared with one measured late. Each steady step at a measured k is
    divided by the median of the served k's last few steady steps, taken just before:
    the drift cancels in the ratio. The served k has ratio 1; switching to k' rebases
    every ratio on k'.
    """

    def __init__(self, max_k: int, served: int, window: int = 32, reference: int = 6):
        self.max_k, self.served = max_k, served
        self.ratios = [deque(maxlen=window) for _ in range(max_k + 1)]
        self.reference = deque(maxlen=reference)
        self.served_seconds = float("nan")
        self._medians: dict[int, float] = {}  # ratio(k) until k's next sample: read at every step

    def observe(self, k: int, seconds: float) -> None:
        if k == self.served:
            self.reference.append(seconds)
            self.served_seconds = statistics.median(self.reference)
        elif len(self.reference) >= 3:
            self.ratios[k].append(seconds / self.served_seconds)
            self._medians.pop(k, None)

    def ratio(self, k: int) -> float:
        # statistics.median, not np.median: the same value (the middle element, or the mean of the
        # two middle ones) at a tenth of the cost on these short deques, and the controller runs
        # in the engine core on every step.
        if k == self.served:
            return 1.0
        median = self._medians.get(k)
        if median is None:
            median = self._medians[k] = statistics.median(self.ratios[k]) if self.ratios[k] else math.nan
        return median

    def samples(self, k: int) -> int:
        return len(self.reference) if k == self.served else len(self.ratios[k])

    def ratio_stderr(self, k: int) -> float:
        """Standard error of ``ratio(k)``, a median (1.25 x that of a mean); 0 for the served k."""
        if k == self.served or len(self.ratios[k]) < 2:
            return 0.0
        samples = self.ratios[k]
        n = len(samples)
        mean = sum(samples) / n
        variance = sum((r - mean) ** 2 for r in samples) / (n - 1)  # statistics.stdev: exact, much slower
        return 1.2533 * math.sqrt(variance / n)

    def envelope(self, k: int) -> float:
        """``ratio(k)`` made monotone in k: no larger k cheaper than a smaller one, none below the
        served k's 1.0 above it, none above it below."""
        lo, hi = sorted((k, self.served))
        ratios = [self.ratio(j) for j in range(lo, hi + 1)]
        ratios = [r for r in ratios if not math.isnan(r)]
        return max(ratios) if k > self.served else min(ratios)

    def serve(self, k: int) -> None:
        """Make ``k`` the reference: every other ratio is re-expressed against it."""
        if k == self.served:
            return
        base = self.ratio(k)
        for j in range(self.max_k + 1):
            if j != k:
                old = [1.0] * self.reference.maxlen if j == self.served else list(self.ratios[j])
                self.ratios[j] = deque((r / base for r in old), maxlen=self.ratios[j].maxlen)
        self.ratios[k].clear()
        self.reference.clear()
        self._medians.clear()
        self.served, self.served_seconds = k, float("nan")
