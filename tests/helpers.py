"""Run engine snippets in a fresh interpreter: vLLM allows one engine per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 600,
               expect_failure: bool = False) -> str:
    """Run ``code`` in a subprocess (in-process engine mode); return its output.

    Fails the test when the subprocess fails (or, with ``expect_failure``, succeeds).
    """
    full_env = dict(os.environ)
    full_env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if expect_failure:
        assert proc.returncode != 0, f"subprocess was expected to fail:\n{out[-3000:]}"
    else:
        assert proc.returncode == 0, f"subprocess failed (rc={proc.returncode}):\n{out[-6000:]}"
    return out


def result_json(output: str, tag: str = "RESULT") -> dict:
    """The JSON a snippet printed on a line starting with ``tag``."""
    for line in reversed(output.splitlines()):
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise AssertionError(f"no {tag} line in output:\n{output[-4000:]}")


def perturbed_checkpoint(model_dir, out, seed: int, scale: float = 0.3):
    """A copy of ``model_dir`` whose matrices moved by ``scale`` of their std (an RL step, exaggerated)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(model_dir / "model.safetensors")
    save_file({k: (v + scale * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
               if v.is_floating_point() and v.dim() == 2 else v for k, v in weights.items()},
              out / "model.safetensors")
    return out
