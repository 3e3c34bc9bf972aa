"""The package as a user gets it without a registry: a wheel built from the clone, installed into a fresh
virtual environment beside an existing vLLM, registers both vLLM plugins from the wheel and runs its
command. (Which import comes from where is checked: the clone's own editable install must not answer.)

Engines: none; a wheel build (pip) and the fresh environment's interpreter, in the slower tier.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import importlib.metadata as m, json, vllm, vllm_specrl
from vllm_specrl.endpoints import endpoint_plugin
from vllm_specrl.plugin import register
dist = m.distribution("vllm-specrl")
eps = {ep.group: ep.value for ep in dist.entry_points}
print("RESULT " + json.dumps({"package": vllm_specrl.__file__, "dist": str(dist._path), "vllm": vllm.__version__,
                              "entry_points": eps}))
"""


def test_a_built_wheel_installs_beside_vllm(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("vllm_specrl-*.whl"))
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # vLLM, torch and the rest from this environment, as a user's existing vLLM install
    (site / "beside_vllm.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True)
    out = subprocess.run([python, "-c", PROBE], check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    got = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert got["package"].startswith(str(env_dir)), got  # the wheel's copy, not the clone's
    assert got["dist"].startswith(str(env_dir)), got
    assert got["entry_points"] == {"vllm.general_plugins": "vllm_specrl.plugin:register",
                                   "vllm.endpoint_plugins": "vllm_specrl.endpoints:endpoint_plugin",
                                   "console_scripts": "vllm_specrl.cli:main"}, got
    help_text = subprocess.run([env_dir / "bin" / "vllm-specrl", "--help"], check=True, capture_output=True,
                               text=True, cwd=tmp_path).stdout
    assert "train-draft" in help_text and "doctor" in help_text
