"""Where each engine core publishes its drafter lifecycle (``drafter-dp<rank>.json`` in the serve
instance's shared directory, as adaptive k does), and the gauges the API servers set from it."""

from __future__ import annotations

from pathlib import Path

from vllm_specrl.adaptive.state import publish, remove
from vllm_specrl.instance_state import read_engine_states

__all__ = ["export_gauges", "publish", "read_all", "remove", "state_path"]


def state_path(directory: Path, dp_rank: int = 0) -> Path:
    return directory / f"drafter-dp{dp_rank}.json"


def read_all(directory: Path | None = None) -> dict[int, dict]:
    """Every engine core's latest drafter state, by data-parallel rank."""
    return read_engine_states("drafter", directory)


def export_gauges(directory: Path | None = None) -> dict[int, dict]:
    """``specrl_draft_repairs{engine,cause}``, ``specrl_draft_collapsed{engine}`` and
    ``specrl_draft_refused{engine}`` from the published states (gauges, as with adaptive k: a custom
    collector never reaches a multiprocess /metrics)."""
    from vllm_specrl.metrics import shared_gauge

    states = read_all(directory)
    for rank, state in states.items():
        engine = str(rank)
        repairs = shared_gauge("specrl_draft_repairs", "drafter repairs from the host copy since the engine "
                               "started, by the event they followed", ("engine", "cause"))
        for cause, n in state["repairs"].items():
            repairs.labels(engine=engine, cause=cause).set(n)
        collapse = state.get("collapse") or {}
        shared_gauge("specrl_draft_collapsed", "1 while draft acceptance has collapsed after an event "
                     "(draft_collapsed in /specrl/status)", ("engine",)).labels(engine=engine).set(
            int(bool(collapse.get("active"))))
        shared_gauge("specrl_draft_refused", "1 while drafting is stopped (on_damage=refuse) until a draft "
                     "update arrives", ("engine",)).labels(engine=engine).set(int(state["refusing"] is not None))
    return states
