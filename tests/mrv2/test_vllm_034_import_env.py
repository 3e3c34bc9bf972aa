"""The slower tier's check of vLLM 0.34 (``make check-vllm VERSION=0.34.0``): its wheel's source holds every
touch point of the Model Runner V2 path, and in an import-only environment of it the plugin registers the
package's methods and vLLM's own ``SpeculativeConfig`` resolves each for a checkpoint.

Engines: none; the check script builds a virtual environment (the wheel and its pure-Python requirements
are downloaded, hundreds of MB) and runs one interpreter there: slow tier only, never in ``make test``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_vllm_0_34_resolves_the_packages_methods(fixture_root, tmp_path_factory):
    env_dir = Path(os.environ.get("VLLM_SPECRL_034_ENV", REPO / ".vllm-0.34.0"))
    proc = subprocess.run(["bash", "scripts/check_vllm_import.sh", "0.34.0", str(env_dir)], cwd=REPO,
                          env=dict(os.environ, FIXTURES=str(fixture_root)), capture_output=True, text=True,
                          timeout=3600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "FAIL" not in out, out[-4000:]
    assert "0 missing, changed or skipping a patch" in out
    for method in ("specrl_eagle3", "specrl_mtp", "specrl_history"):
        assert f"ok   {method}: config is the package's" in out
