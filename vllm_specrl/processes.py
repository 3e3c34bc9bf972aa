"""Starting helper processes (the online draft trainer, the capture sender) from a big process without forking it.

``subprocess.Popen`` with a ``preexec_fn`` must ``fork()`` the calling process, and a fork
write-protects every page of the parent for copy-on-write: a policy process holding a 10 GB
heap then takes a page fault on the first write to each of its pages afterwards (in ``make demo``
it made the policy phases of the run with a draft trainer far slower than the run without).
Without ``preexec_fn`` Python spawns with ``vfork()``, which shares nothing to
protect; the niceness is set on the child right after it starts instead.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any


def start_niced(cmd: list[str], niceness: int, idle: bool = False, cpus: set[int] | None = None,
                **popen_kwargs: Any) -> subprocess.Popen:
    """``Popen(cmd)`` at ``niceness`` (threads the child starts later inherit it), without a fork.

    ``idle``: also ``SCHED_IDLE``, the policy for work that should only run on cycles nothing else
    wants (Linux gives it a weight of 3 against nice 19's 15 and a nice-0 task's 1024, and a
    waking normal task always preempts it). ``cpus``: the CPUs it may run on (the threads it starts
    later inherit them), e.g. those a CPU engine's worker leaves to its engine core."""
    if "preexec_fn" in popen_kwargs:
        raise ValueError("start_niced spawns without preexec_fn; a fork would copy-on-write protect the caller")
    proc = subprocess.Popen(cmd, **popen_kwargs)
    try:
        os.setpriority(os.PRIO_PROCESS, proc.pid, niceness)
        if idle:
            os.sched_setscheduler(proc.pid, os.SCHED_IDLE, os.sched_param(0))
        if cpus:
            os.sched_setaffinity(proc.pid, cpus)
    except ProcessLookupError:  # it exited already; nothing left to lower
        pass
    return proc
