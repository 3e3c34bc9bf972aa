"""One vLLM engine per subprocess for the benchmark scripts (vLLM allows one engine per process).

A script re-runs itself with ``--_engine <json config>``; the child prints one
``ENGINE_RESULT <json>`` line, which the parent reads back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

TAG = "ENGINE_RESULT "


def report_result(result: Any) -> None:
    """In the child: hand the result to the parent."""
    print(TAG + json.dumps(result), flush=True)


def run_engine_subprocess(script: str, cfg: dict, env: dict[str, str], timeout_s: float) -> Any:
    """In the parent: run ``script --_engine cfg``; its result, or a string saying why there is none."""
    try:
        proc = subprocess.run([sys.executable, script, "--_engine", json.dumps(cfg)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"engine timed out after {timeout_s:.0f} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    return f"engine failed (rc={proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}"
