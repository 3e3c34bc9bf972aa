"""Where the engine core's adaptive-k state is published for the API server to read.

The controller runs in the engine-core process (inside vLLM's scheduler); the
``/specrl`` routes and ``/metrics`` are served by the API server, its parent (or
the same process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). A small JSON file
keyed by the API server's pid, replaced atomically, is the whole channel: no
socket, nothing that can block the scheduler.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

STATE_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def state_path(frontend_pid: int | None = None) -> Path:
    return STATE_DIR / f"vllm-specrl-adaptive-k-{frontend_pid or os.getpid()}.json"


def publish(state: dict, frontend_pid: int) -> None:
    """Replace the state file atomically (readers never see a partial write)."""
    path = state_path(frontend_pid)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as fh:
        json.dump(state, fh)
    os.replace(tmp, path)


def remove(frontend_pid: int) -> None:
    """Delete the state file (the engine core does at exit, so no stale state outlives it)."""
    state_path(frontend_pid).unlink(missing_ok=True)


def read(frontend_pid: int | None = None) -> dict | None:
    """The latest published state of this API server's engine, or None."""
    try:
        return json.loads(state_path(frontend_pid).read_text())
    except (OSError, ValueError):
        return None


def prometheus_collector(frontend_pid: int | None = None):
    """A collector for vLLM's /metrics registry that reads the state file on every scrape."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class AdaptiveKCollector:
        def collect(self):
            state = read(frontend_pid)
            if not state:
                return
            last = GaugeMetricFamily("specrl_adaptive_k", "k (drafts per step) chosen for the latest step")
            last.add_metric([], state["last_k"])
            yield last
            chosen = CounterMetricFamily("specrl_adaptive_k_steps", "steps scheduled at each k", labels=["k"])
            for k, n in enumerate(state["chosen_k_counts"]):
                chosen.add_metric([str(k)], n)
            yield chosen
            expected = GaugeMetricFamily("specrl_adaptive_k_expected_tokens",
                                         "estimated tokens per request and step at each k", labels=["k"])
            for k, t in enumerate(state["expected_tokens_per_step"]):
                expected.add_metric([str(k)], t)
            yield expected
            if "no_k_pays" in state:
                hopeless = GaugeMetricFamily("specrl_adaptive_k_no_k_pays",
                                             "1 while no k pays at any batch size measured (speculation "
                                             "costs its bookkeeping for nothing: serve without it)")
                hopeless.add_metric([], int(state["no_k_pays"]))
                yield hopeless

    return AdaptiveKCollector()
