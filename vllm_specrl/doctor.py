"""``vllm-specrl doctor``: what this package does to the vLLM on this machine, before anything is served.

Installs every patch and registration in this process as a model-running vLLM process would (the
plugin's own steps), then lists each patch with its state (installed; skipped and why; failed and the
error), its scope and its switch, with the platform and the vLLM version, and checks every touch point
against the installed vLLM's source. Exit status 1 when the vLLM is outside the supported range, a
patch failed, or a touch point is missing or would make a patch skip.
"""

from __future__ import annotations

import platform as host
from pathlib import Path
from typing import Any

from vllm_specrl._version import __version__


def diagnose() -> dict[str, Any]:
    """The doctor's findings as JSON-safe values."""
    import torch
    import vllm
    from vllm.platforms import current_platform

    from vllm_specrl import patches
    from vllm_specrl.compat import version as vllm_versions
    from vllm_specrl.compat.registry import REGISTRY
    from vllm_specrl.compat.source_check import compare, runner_of_source

    version = vllm_versions.vllm_version()
    supported = vllm_versions.is_supported(version)
    root = Path(vllm.__file__).parents[1]
    runner = runner_of_source(root)
    steps = {}
    if supported:
        kept, not_ported = patches.steps_for(runner, runs_model=True)
        steps = {step.key: "not ported to Model Runner V2" for step in not_ported}
        for step in kept:
            steps[step.key] = patches.install_step(step)
    rows, failures = compare(REGISTRY, root, root, runner)
    report = REGISTRY.report()
    failed = [row["name"] for row in report if row["state"] == "failed"]
    return {
        "vllm_specrl": __version__, "vllm": version, "supported": supported,
        "validation": vllm_versions.validation(version),
        "supported_range": vllm_versions.SUPPORTED_RANGE, "torch": torch.__version__, "model_runner": runner,
        "platform": {"device_type": str(current_platform.device_type), "is_cpu": current_platform.is_cpu(),
                     "cuda_available": torch.cuda.is_available(), "machine": host.machine(),
                     "processor": host.processor() or None},
        "steps": steps, "patches": report,
        "touch_points": {"checked": len(rows), "failing": [r for r in rows if r["verdict"] in ("missing", "changed")
                                                           or r["verdict"].startswith("patch skips")]},
        "ok": supported and not failed and not failures,
    }


def format_report(found: dict[str, Any]) -> str:
    """The findings as a table a person reads."""
    plat = found["platform"]
    lines = [f"vllm-specrl {found['vllm_specrl']} on vLLM {found['vllm']} "
             f"({'supported' if found['supported'] else 'NOT supported: ' + found['supported_range']}), "
             f"torch {found['torch']}, platform {plat['device_type']} ({plat['machine']})",
             f"this vLLM release: {found['validation']}; speculators on the {found['model_runner']} model runner",
             ""]
    width = max((len(row["name"]) for row in found["patches"]), default=10)
    lines.append(f"{'patch':{width}}  {'state':11}  {'scope':10}  switch / detail")
    for row in found["patches"]:
        lines.append(f"{row['name']:{width}}  {row['state']:11}  {row['scope']:10}  {row['switch']}"
                     + (f"  ({row['detail']})" if row["detail"] else ""))
    points = found["touch_points"]
    lines.append("")
    lines.append(f"touch points: {points['checked']} checked against the installed vLLM, "
                 f"{len(points['failing'])} failing")
    lines += [f"  {row['verdict']}: {row['file']}::{row['name']}" for row in points["failing"]]
    lines.append("")
    lines.append("doctor: OK" if found["ok"] else "doctor: PROBLEMS (see above)")
    return "\n".join(lines)
