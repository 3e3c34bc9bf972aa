"""The collapse alarm: acceptance that falls to nothing, where the window before read clearly higher.

Counted in drafts (a request's drafts verified in one step), as vLLM's ``spec_decode`` counters count
them: a window's acceptance length is 1 + accepted tokens / drafts. A window collapses when it reads
below ``below`` (or accepted nothing) while the window before read at least ``drop`` higher: a draft
that drifts slowly with the policy never trips it; an emptied or overwritten drafter does within one
window. Pure bookkeeping; the engine core feeds it each step's verified drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CollapseDetector:
    window: int = 64
    below: float = 1.05
    drop: float = 0.25
    drafts: int = 0
    accepted: int = 0
    previous: float | None = None   # the last full window's acceptance length
    history: list[float] = field(default_factory=list)

    def observe(self, verified: list[tuple[int, int]]) -> dict | None:
        """Add one step's ``(drafts, accepted)`` per request; a verdict when a window fills: ``{"length",
        "previous", "collapsed"}``."""
        for _, accepted in verified:
            self.drafts += 1
            self.accepted += accepted
        if self.drafts < self.window:
            return None
        length = 1.0 + self.accepted / self.drafts
        collapsed = (self.previous is not None and (length < self.below or self.accepted == 0)
                     and self.previous >= length + self.drop)
        verdict = {"length": round(length, 4), "previous": None if self.previous is None else round(self.previous, 4),
                   "collapsed": collapsed, "drafts": self.drafts}
        self.history = [*self.history[-7:], round(length, 4)]
        self.previous = length
        self.drafts = self.accepted = 0
        return verdict
