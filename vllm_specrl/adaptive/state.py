"""Where the engine cores' adaptive-k state is published for the API servers to read.

The controller runs in each engine-core process (inside vLLM's scheduler); the
``/specrl`` routes and ``/metrics`` are served by the API servers. One small
JSON file per engine core (``adaptive-k-dp<rank>.json``) in the serve
instance's shared directory (``instance_state.instance_dir``), replaced
atomically, is the whole channel: no socket, nothing that can block the
scheduler, and every API server of a data-parallel ``vllm serve`` reads every
core's state.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from vllm_specrl.instance_state import read_engine_states



def state_path(directory: Path, dp_rank: int = 0) -> Path:
    return directory / f"adaptive-k-dp{dp_rank}.json"


def publish(state: dict, path: Path) -> None:
    """Replace the state file atomically (readers never see a partial write)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as fh:
        json.dump(state, fh)
    os.replace(tmp, path)


def remove(path: Path) -> None:
    """Delete the state file (the engine core does at exit, so no stale state outlives it)."""
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()  # the last one out of a single server's directory
    except OSError:
        pass


def read_all(directory: Path | None = None) -> dict[int, dict]:
    """Every engine core's latest state, by data-parallel rank."""
    return read_engine_states("adaptive-k", directory)


def read(directory: Path | None = None) -> dict | None:
    """The first engine core's state (with ``data_parallel``: every core's, when there are several), or None."""
    states = read_all(directory)
    if not states:
        return None
    first = dict(states[min(states)])
    if len(states) > 1:
        first["data_parallel"] = {str(rank): s for rank, s in states.items()}
    return first


def export_gauges(directory: Path | None = None) -> int:
    """Set the ``specrl_adaptive_k*`` gauges (label ``engine``: the core's data-parallel rank) from the
    published states; called when /metrics or /specrl/status is served. Gauges, not a collector: with
    several API servers vLLM serves /metrics from Prometheus' multiprocess files, where a custom
    collector never appears. Returns the number of engine cores found."""
    from vllm_specrl.metrics import shared_gauge

    states = read_all(directory)
    for rank, state in states.items():
        engine = str(rank)
        shared_gauge("specrl_adaptive_k", "k (drafts per step) chosen for the latest step",
                     ("engine",)).labels(engine=engine).set(state["last_k"])
        steps = shared_gauge("specrl_adaptive_k_steps", "steps scheduled at each k (since the engine started)",
                             ("engine", "k"))
        for k, n in enumerate(state["chosen_k_counts"]):
            steps.labels(engine=engine, k=str(k)).set(n)
        expected = shared_gauge("specrl_adaptive_k_expected_tokens",
                                "estimated tokens per request and step at each k", ("engine", "k"))
        for k, t in enumerate(state["expected_tokens_per_step"]):
            expected.labels(engine=engine, k=str(k)).set(t)
        if "no_k_pays" in state:
            shared_gauge("specrl_adaptive_k_no_k_pays",
                         "1 while no k pays at any batch size measured (speculation costs its bookkeeping "
                         "for nothing: serve without it)", ("engine",)).labels(engine=engine).set(
                int(state["no_k_pays"]))
    return len(states)
