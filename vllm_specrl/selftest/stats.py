"""Two-sample tests of sampled continuations: is a speculative engine's output distribution the plain
engine's? One chi-square test per output position, rare tokens pooled into one bin."""

from __future__ import annotations

from collections import Counter


def per_position_pvalues(a: list[list[int]], b: list[list[int]], min_count: int = 10) -> list[float]:
    """Two-sample chi-square p-value per position (rare tokens pooled into one bin)."""
    from scipy.stats import chi2_contingency

    pvalues = []
    for pos in range(min(len(a[0]), len(b[0]))):
        ca = Counter(s[pos] for s in a)
        cb = Counter(s[pos] for s in b)
        common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= min_count]
        rows = [[ca[t] for t in common], [cb[t] for t in common]]
        rest_a = len(a) - sum(rows[0])
        rest_b = len(b) - sum(rows[1])
        if rest_a + rest_b > 0:
            rows[0].append(rest_a)
            rows[1].append(rest_b)
        if len(rows[0]) < 2:
            pvalues.append(1.0)  # a single category on both sides: identical
            continue
        pvalues.append(float(chi2_contingency(rows)[1]))
    return pvalues


def padded(samples: list[list[int]], length: int, end: int = -1) -> list[list[int]]:
    """Samples that stopped early, filled to ``length`` with ``end``: where and whether a sample
    stopped becomes part of what ``per_position_pvalues`` compares."""
    return [list(s) + [end] * (length - len(s)) for s in samples]
