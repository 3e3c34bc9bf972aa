"""Failpoints: faults injected on purpose, to prove that recovery paths work.

Off unless ``VLLM_SPECRL_FAULTS`` is set in the engine's environment. Each entry
``<kind>:<target>:<version>:<n>[@<rank>|@dp<rank>]`` acts during the commit of that update
(``policy`` or ``draft``, that version; on every worker, or only on that tensor-parallel
rank, or only in that data-parallel engine core)
after applying ``n`` tensors: kind ``apply`` raises, exactly as a failure inside
vLLM's weight loader would; kind ``kill`` SIGKILLs the worker's process, as an
out-of-memory kill or a lost host would. Versions pick the faulty update, so a
test can arm a server once and still run every other update normally. Kind ``refuse`` acts in the
``specrl_gloo`` backend, where a round has no version until it is applied: its "version" is the
round's number on that engine (1, 2, ...), and the engine refuses that round after receiving it, as
a validation failure would. Entry ``logprobs:<delta>`` shifts the logprobs the CPU rejection sampler
returns for verified rows by ``delta`` (a lossy logprob path, which the self-test's logprob conformance
check must catch).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator
from typing import Any

FAULTS_ENV = "VLLM_SPECRL_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by a failpoint (never in normal operation)."""


KINDS = ("apply", "kill", "refuse")


def armed_fault(target: str, version: int, rank: int | None = None,
                dp_rank: int | None = None) -> tuple[str, int] | None:
    """``(kind, tensors applied before it)`` for this update on this rank, or None."""
    for entry in filter(None, (e.strip() for e in os.environ.get(FAULTS_ENV, "").split(","))):
        entry, _, only_rank = entry.partition("@")
        parts = entry.split(":")
        if only_rank and only_rank != (f"dp{dp_rank}" if only_rank.startswith("dp") else str(rank)):
            continue
        if len(parts) == 4 and parts[0] in KINDS and parts[1] == target and parts[2] == str(version):
            return parts[0], int(parts[3])
    return None


def with_apply_fault(named: Iterable[tuple[str, Any]], target: str, version: int,
                     rank: int | None = None, dp_rank: int | None = None) -> Iterator[tuple[str, Any]]:
    """``named`` unchanged, or failing after the configured number of tensors."""
    kind, after = armed_fault(target, version, rank, dp_rank) or (None, None)
    for i, item in enumerate(named):
        if i == after:
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise InjectedFault(f"injected fault ({FAULTS_ENV}): {target} v{version} after {after} tensors")
        yield item


def logprob_shift() -> float:
    """The ``logprobs:<delta>`` failpoint's shift (0.0 when not armed)."""
    for entry in filter(None, (e.strip() for e in os.environ.get(FAULTS_ENV, "").split(","))):
        kind, _, delta = entry.partition(":")
        if kind == "logprobs":
            return float(delta)
    return 0.0
