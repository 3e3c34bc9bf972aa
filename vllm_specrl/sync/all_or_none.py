"""One rule for a commit across ranks, whoever drives it (the HTTP routes, an in-process ``LLM``):
every rank applies, or every rank goes back to what it served before.

A rank that fails while applying restores its own last good weights; the ranks that applied are then
told to roll back (``specrl_rollback_commit``); only when none failed is the previous set freed
(``specrl_finalize_commit``). These helpers turn the ranks' answers into the one answer the caller gets.
"""

from __future__ import annotations


def first_refusal(answers: list[dict]) -> dict:
    """The first rank's refusal among ``answers``, else rank 0's answer."""
    for answer in answers:
        if not answer.get("ok", False):
            return answer
    return answers[0]


def needs_rollback(answers: list[dict]) -> bool:
    """Some ranks failed to apply and some applied: the ones that applied must go back."""
    failed = sum(not a.get("ok") for a in answers)
    return 0 < failed < len(answers)


def failure_after_rollback(answers: list[dict], undone: list[dict] | None) -> dict:
    """The caller's answer for a commit some rank failed: the first failure, with which ranks went back
    (``undone``: the ranks' answers to the rollback, None when no rank had applied) and whether every
    rank now serves the previous weights."""
    res = dict(next(a for a in answers if not a.get("ok")))
    if undone is not None:
        res["ranks_rolled_back"] = [i for i, r in enumerate(undone) if r.get("rolled_back")]
        bad = [r["error"] for r in undone if not r.get("ok")]
        if bad:
            res["rolled_back"] = False
            res["error"] += "; " + "; ".join(bad)
    return res
