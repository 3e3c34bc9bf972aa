"""Failpoints: faults injected on purpose, to prove that recovery paths work.

Off unless ``VLLM_SPECRL_FAULTS`` is set in the engine's environment. Each entry
``apply:<target>:<version>:<n>[@<rank>]`` makes the commit of that update
(``policy`` or ``draft``, that version; on every worker, or only on that rank)
raise after applying ``n`` tensors, exactly as a failure inside vLLM's weight
loader would. Versions pick the faulty update, so a test can
arm a server once and still run every other update normally.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

FAULTS_ENV = "VLLM_SPECRL_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by a failpoint (never in normal operation)."""


def apply_fault_after(target: str, version: int, rank: int | None = None) -> int | None:
    """Tensors to apply before the injected failure of this update on this rank, or None."""
    for entry in filter(None, (e.strip() for e in os.environ.get(FAULTS_ENV, "").split(","))):
        entry, _, only_rank = entry.partition("@")
        parts = entry.split(":")
        if only_rank and str(rank) != only_rank:
            continue
        if len(parts) == 4 and parts[0] == "apply" and parts[1] == target and parts[2] == str(version):
            return int(parts[3])
    return None


def with_apply_fault(named: Iterable[tuple[str, Any]], target: str, version: int,
                     rank: int | None = None) -> Iterator[tuple[str, Any]]:
    """``named`` unchanged, or failing after the configured number of tensors."""
    after = apply_fault_after(target, version, rank)
    for i, item in enumerate(named):
        if after is not None and i == after:
            raise InjectedFault(f"injected fault ({FAULTS_ENV}): {target} v{version} after {after} tensors")
        yield item
