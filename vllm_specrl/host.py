"""What machine this is, for every result file: figures from different CPUs are not comparable."""

from __future__ import annotations

import os
import platform
from typing import Any

# The instruction-set extensions that change what a CPU step costs here: vLLM's CPU kernels
# and oneDNN pick AVX-512 / AVX-512-BF16 / AMX paths when present, so the same benchmark
# reads differently on an AVX2-only machine.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def host_info(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """What machine a benchmark ran on: results from different CPUs are not comparable."""
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and "cpu_model" not in info:
            info["cpu_model"] = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            info["isa"] = [f for f in ISA_FLAGS if f in flags]
            break
    return info
