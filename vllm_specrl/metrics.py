"""Speculative-decoding acceptance figures from vLLM's ``vllm:spec_decode_*`` counters.

vLLM exports four counters: drafts, draft tokens, accepted tokens, and
accepted tokens per draft position. The same arithmetic turns them into
acceptance rate, acceptance length (1 + accepted / drafts, counting the bonus
token, the convention of vLLM and the EAGLE papers) and per-position
acceptance, whether they come from the API server's Prometheus registry,
from ``LLM.get_metrics()`` offline, or from scraped ``/metrics`` text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecDecodeCounters:
    """Raw counter totals (summed over engines)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)

    def add_sample(self, name: str, labels: dict[str, str], value: float) -> None:
        """Fold one counter sample in; names may carry Prometheus' ``_total`` suffix."""
        base = name.removesuffix("_total")
        if base == DRAFTS:
            self.num_drafts += value
        elif base == DRAFT_TOKENS:
            self.num_draft_tokens += value
        elif base == ACCEPTED:
            self.num_accepted_tokens += value
        elif base == ACCEPTED_PER_POS:
            pos = int(labels["position"])
            self.accepted_per_position[pos] = self.accepted_per_position.get(pos, 0.0) + value

    def minus(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        """Counts accrued since ``before`` (for per-phase figures in benchmarks)."""
        return SpecDecodeCounters(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            {p: v - before.accepted_per_position.get(p, 0.0)
             for p, v in self.accepted_per_position.items()},
        )

    def summary(self) -> dict[str, Any]:
        """JSON-ready acceptance figures; ratios are None before any draft."""
        drafts, tokens = self.num_drafts, self.num_draft_tokens
        positions = sorted(self.accepted_per_position)
        return {
            "num_drafts": int(drafts),
            "num_draft_tokens": int(tokens),
            "num_accepted_tokens": int(self.num_accepted_tokens),
            "acceptance_rate": self.num_accepted_tokens / tokens if tokens else None,
            "acceptance_length": 1.0 + self.num_accepted_tokens / drafts if drafts else None,
            "per_position_acceptance": (
                [self.accepted_per_position[p] / drafts for p in positions] if drafts else []
            ),
            "accepted_per_position": [int(self.accepted_per_position[p]) for p in positions],
        }

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> SpecDecodeCounters:
        """The counters back from a ``summary()`` (e.g. two ``/specrl/status`` snapshots, to take the
        delta of a phase with ``minus``)."""
        return cls(summary["num_drafts"], summary["num_draft_tokens"], summary["num_accepted_tokens"],
                   dict(enumerate(summary.get("accepted_per_position", []))))


def summary_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The summary of what accrued between two ``summary()`` snapshots (a phase, an RL step)."""
    return SpecDecodeCounters.from_summary(after).minus(SpecDecodeCounters.from_summary(before)).summary()


def served_registry() -> Any:
    """The registry this server's /metrics shows: with several API servers (Prometheus' multiprocess
    mode) every process's counters summed, as vLLM serves them; else this process's own."""
    import prometheus_client

    from vllm_specrl.instance_state import several_api_servers

    if several_api_servers():
        from prometheus_client import multiprocess

        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return prometheus_client.REGISTRY


_SHARED_GAUGES: dict[str, Any] = {}


def shared_gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
    """A process-wide gauge on vLLM's /metrics registry (created on first use). With several API
    servers the value any process set last is the one shown (``mostrecent``), not one series per pid:
    each process sets it from the shared record, so they agree."""
    import prometheus_client

    if name not in _SHARED_GAUGES:
        try:
            _SHARED_GAUGES[name] = prometheus_client.Gauge(name, doc, labels, multiprocess_mode="mostrecent")
        except ValueError:  # already registered in this process
            _SHARED_GAUGES[name] = prometheus_client.REGISTRY._names_to_collectors[name]
    return _SHARED_GAUGES[name]


def from_prometheus_registry(registry: Any = None) -> SpecDecodeCounters:
    """Read the counters from a ``prometheus_client`` registry (default: what /metrics shows,
    ``served_registry``)."""
    registry = registry or served_registry()
    counters = SpecDecodeCounters()
    for metric in registry.collect():
        if not metric.name.startswith("vllm:spec_decode"):
            continue
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counters.add_sample(sample.name, dict(sample.labels), sample.value)
    return counters


def from_llm_metrics(metrics: Iterable[Any]) -> SpecDecodeCounters:
    """Read the counters from ``LLM.get_metrics()`` (offline engines)."""
    counters = SpecDecodeCounters()
    for metric in metrics:
        if not metric.name.startswith("vllm:spec_decode"):
            continue
        if hasattr(metric, "values"):  # Vector: one value per position
            for pos, value in enumerate(metric.values):
                counters.add_sample(metric.name, {"position": str(pos)}, float(value))
        elif hasattr(metric, "value"):
            counters.add_sample(metric.name, dict(metric.labels), float(metric.value))
    return counters


def from_prometheus_text(text: str) -> SpecDecodeCounters:
    """Read the counters from a scraped ``/metrics`` page."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = SpecDecodeCounters()
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:spec_decode"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                counters.add_sample(sample.name, dict(sample.labels), sample.value)
    return counters
