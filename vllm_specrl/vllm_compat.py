"""The one module that touches vLLM beyond its documented plugin contracts.

Every touch point is listed here with the vLLM versions it was checked on.
Anything not in this table is a public, documented interface (entry-point
groups, ``--worker-extension-cls`` + ``collective_rpc``, OpenAI routes,
``LLM.get_metrics``, the ``vllm:spec_decode_*`` Prometheus counters).

| Touch point                                   | Used for                          | Checked on        |
|-----------------------------------------------|-----------------------------------|-------------------|
| ``vllm.__version__``                          | version gate in the plugin        | 0.32.0 (cpu)      |
| ``AsyncLLM.vllm_config.speculative_config``   | speculative config in /status     | 0.32.0 (cpu)      |
| worker ``self.model_runner``, ``.get_model()``,| worker state in /status           | 0.32.0 (cpu)      |
| ``model_runner.drafter``                      |                                   |                   |
| ``prometheus_client.REGISTRY`` in API server  | spec-decode counters in /status   | 0.32.0 (cpu)      |

0.33.0 was read (not run) for the same attributes; see
``../shared/vllm-extension-map.md`` section 8.
"""

from __future__ import annotations

import re
from typing import Any

SUPPORTED_RANGE = ">=0.32,<0.34"
SUPPORTED_MINORS = ((0, 32), (0, 33))


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside the range this package was checked against."""


def vllm_version() -> str:
    """The running vLLM's version string (e.g. ``0.32.0`` or ``0.33.1+cpu``)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def parse_major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"^(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_supported(version: str) -> bool:
    return parse_major_minor(version) in SUPPORTED_MINORS


def check_supported(version: str | None = None) -> str:
    """Return the version if supported, else raise with the supported range."""
    version = version or vllm_version()
    if not is_supported(version):
        raise UnsupportedVLLMVersion(
            f"vllm-specrl supports vLLM {SUPPORTED_RANGE} (0.32.x, 0.33.x); found {version}"
        )
    return version


# --- engine / config --------------------------------------------------------

_SPEC_FIELDS = (
    "method", "model", "num_speculative_tokens", "draft_sample_method",
    "rejection_sample_method", "parallel_drafting", "disable_padded_drafter_batch",
)


def speculative_config_summary(vllm_config: Any) -> dict[str, Any] | None:
    """The speculative config in force, as JSON-safe values (None when off)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    out: dict[str, Any] = {}
    for name in _SPEC_FIELDS:
        if hasattr(spec, name):
            value = getattr(spec, name)
            out[name] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
    return out


# --- worker -----------------------------------------------------------------

def worker_model_summary(worker: Any) -> dict[str, Any]:
    """Class names of the worker's target model and drafter (if any)."""
    runner = getattr(worker, "model_runner", None)
    model = runner.get_model() if runner is not None and hasattr(runner, "get_model") else None
    drafter = getattr(runner, "drafter", None) if runner is not None else None
    draft_model = getattr(drafter, "model", None)
    return {
        "runner": type(runner).__name__ if runner is not None else None,
        "model": type(model).__name__ if model is not None else None,
        "drafter": type(drafter).__name__ if drafter is not None else None,
        "draft_model": type(draft_model).__name__ if draft_model is not None else None,
    }
