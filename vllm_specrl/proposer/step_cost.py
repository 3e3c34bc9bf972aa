"""What a verified token costs, measured from the engine's own steps: when a history draft pays.

A draft-free proposer (the history look-up) costs nothing to draft, but every drafted token is
a row the target must verify. Whether a token is worth verifying depends on the hardware and
the batch: a step's time is about ``F + R * rows`` (rows: one per sequence plus its drafts) and
a plain step at ``b`` sequences yields ``b`` tokens in ``F + R * b``, so a drafted token that is
accepted with probability ``pi`` raises tokens per second only if

    pi > R * b / (F + R * b)          (the threshold for ``b`` sequences)

On a GPU a verify pass is memory-bound and ``R`` is near zero: drafting pays at any acceptance.
On a CPU ``R`` is a real share of a step, so the threshold grows with the batch, and a fixed one
drafts tokens that cannot pay at large batches while leaving acceptance unused at small ones.

``StepCostModel`` fits ``seconds = F + R * rows + S * drafted`` (``drafted``: any row verified a
draft, vLLM's speculative path then runs its rejection sampler) by least squares over the
last ``window`` clean steps (no request joined, no prompt chunk: a prefill's rows cost
differently), refitting every ``refit_every`` steps with outliers beyond ``outlier_mads``
median absolute deviations dropped (a step that waited for the host). Rows vary as a rollout's
sequences finish and as drafts come and go, which is what makes ``R`` identifiable; until the
fit has ``min_steps`` steps over at least three row counts it reports no threshold and the
caller keeps its fixed one.

The line is fitted twice: over all steps, and per batch size over the steps of about that
batch (half to twice it), which is the one used where it can be fitted and makes sense (a
positive cost per row and fixed part). A row's cost depends on the batch wherever a step
turns from memory-bound to compute-bound as rows are added (a GPU at large batches, a CPU
in bf16 at a few rows).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

MIN_THRESHOLD = 0.02   # a draft whose chance is below this is noise, free rows or not
MAX_THRESHOLD = 0.99   # nothing drafts: a token accepted for sure only just pays its row


def batch_range(batch: int) -> tuple[int, int]:
    """The batch sizes whose steps tell what a row costs at ``batch``: half to twice it."""
    return max(1, batch // 2), 2 * batch


@dataclass(frozen=True)
class StepCostFit:
    fixed_s: float       # F: a step's cost besides its rows
    per_row_s: float     # R: one more row verified
    spec_path_s: float   # S: vLLM's speculative path, paid by a step that verifies any draft
    steps: int           # clean steps the fit used (outliers dropped)

    def threshold(self, batch: int) -> float:
        """The acceptance chance a drafted token needs at ``batch`` sequences to raise tokens/s."""
        rows_cost = max(self.per_row_s, 0.0) * max(batch, 1)
        plain_step = self.fixed_s + rows_cost
        if plain_step <= 0.0:
            return MAX_THRESHOLD
        return float(min(max(rows_cost / plain_step, MIN_THRESHOLD), MAX_THRESHOLD))


class StepCostModel:
    """Least-squares step cost over recent clean steps; ``fit`` is None until it can be trusted."""

    def __init__(self, window: int = 512, min_steps: int = 32, refit_every: int = 16,
                 outlier_mads: float = 4.0):
        self.samples: deque[tuple[int, int, bool, float]] = deque(maxlen=window)
        self.min_steps, self.refit_every, self.outlier_mads = min_steps, refit_every, outlier_mads
        self.fit: StepCostFit | None = None
        self.local: dict[int, StepCostFit | None] = {}   # per batch size asked for, reset at each refit
        self._since_fit = 0

    def observe(self, batch: int, rows: int, drafted: bool, seconds: float) -> None:
        """One clean step of ``batch`` sequences: ``rows`` verified in all, whether any was a draft,
        its wall time."""
        if batch <= 0 or rows < batch or not np.isfinite(seconds) or seconds <= 0.0:
            return
        self.samples.append((int(batch), int(rows), bool(drafted), float(seconds)))
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len(self.samples) >= self.min_steps:
            self._since_fit = 0
            self.fit = self._fit(np.asarray(self.samples, dtype=np.float64))
            self.local = {}

    def fit_for(self, batch: int) -> StepCostFit | None:
        """The fit over the steps of about ``batch`` sequences where there are enough, else over all."""
        if self.fit is None:
            return None
        if batch not in self.local:
            data = np.asarray(self.samples, dtype=np.float64)
            lo, hi = batch_range(batch)
            near = data[(data[:, 0] >= lo) & (data[:, 0] <= hi)]
            local = self._fit(near) if len(near) >= self.min_steps else None
            # A local line with a row costing nothing or less, or no fixed part, is the noise of a few
            # tail steps (a negative cost a row over one- and two-sequence steps): the line over all steps.
            self.local[batch] = local if local is not None and local.per_row_s > 0 and local.fixed_s > 0 else None
        return self.local[batch] or self.fit

    def threshold(self, batch: int) -> float | None:
        fit = self.fit_for(batch)
        return None if fit is None else fit.threshold(batch)

    def _fit(self, data: np.ndarray) -> StepCostFit | None:
        rows, drafted, seconds = data[:, 1], data[:, 2], data[:, 3]
        if len(np.unique(rows)) < 3:
            return None
        use_spec_path = 0.0 < drafted.mean() < 1.0
        design = np.column_stack([np.ones_like(rows), rows] + ([drafted] if use_spec_path else []))
        keep = np.ones(len(rows), dtype=bool)
        for _ in range(2):  # fit, drop the outliers of that fit, fit again
            coef = np.linalg.lstsq(design[keep], seconds[keep], rcond=None)[0]
            residual = seconds - design @ coef
            mad = np.median(np.abs(residual[keep] - np.median(residual[keep])))
            keep = np.abs(residual) <= self.outlier_mads * 1.4826 * mad if mad > 0 else keep
            if keep.sum() < self.min_steps or len(np.unique(rows[keep])) < 3:
                return None
        coef = np.linalg.lstsq(design[keep], seconds[keep], rcond=None)[0]
        return StepCostFit(fixed_s=float(coef[0]), per_row_s=float(coef[1]),
                           spec_path_s=float(coef[2]) if use_spec_path else 0.0, steps=int(keep.sum()))

    def status(self) -> dict:
        fit = self.fit
        if fit is None:
            return {"clean_steps": len(self.samples), "fitted": False}
        by_batch = {}
        for b in (1, 2, 4, 8, 16, 32):
            local = self.fit_for(b)
            by_batch[b] = {"threshold": round(local.threshold(b), 3), "per_row_ms": round(1e3 * local.per_row_s, 3),
                           "fixed_ms": round(1e3 * local.fixed_s, 3), "local": local is not fit}
        return {"clean_steps": len(self.samples), "fitted": True, "fixed_ms": 1e3 * fit.fixed_s,
                "per_row_ms": 1e3 * fit.per_row_s, "spec_path_ms": 1e3 * fit.spec_path_s, "fit_steps": fit.steps,
                "by_batch": by_batch}
