"""The README cannot drift from the package: its RL-loop example runs against a server started with the
README's own serve command (the tiny fixture, a random EAGLE-3 draft), its switches table lists every
switch the package has, every docs page it links exists, and it stays a guide (at most 300 lines).

Engines: one ``vllm serve`` (the README's command, on the tiny model) for the example; the example is
the user's process and runs as one (a fresh interpreter)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_specrl.switches import CPU, SWITCHES

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def serve_command() -> list[str]:
    """The README's ``vllm serve`` command's flags after the model, as a shell would split them."""
    block = next(b for b in fenced_blocks("bash") if "vllm serve /ckpt/policy" in b)
    words = shlex.split(block.replace("\\\n", " "))
    return words[words.index("/ckpt/policy") + 1:]


def test_the_readme_stays_a_guide():
    assert len(README.splitlines()) <= 300


def test_every_switch_is_in_the_readme_table_or_the_cpu_shortcuts_page():
    table = README.split("## Switches", 1)[1].split("\n## ", 1)[0]
    missing = [s.name for s in SWITCHES if not s.group and f"`{s.name}`" not in table]
    assert not missing, f"README's switches table lacks {missing}"
    page = (REPO / "docs" / "cpu-shortcuts.md").read_text()
    missing = [s.name for s in SWITCHES if s.group == CPU and f"`{s.name}`" not in page]
    assert not missing, f"docs/cpu-shortcuts.md lacks {missing}"
    assert not [s.name for s in SWITCHES if s.group == CPU and f"`{s.name}`" in table], "a GPU user reads past them"


def test_every_linked_page_exists():
    links = re.findall(r"\]\(((?:docs|benchmarks|examples)/[^)#]+)\)", README)
    assert len(links) >= 10
    assert [link for link in links if not (REPO / link).exists()] == []


@pytest.fixture
def readme_server(tiny_model, tmp_path):
    from vllm_specrl.proposer.checkpoint import init_draft
    from vllm_specrl.launcher import VLLMServer, free_port

    init_draft(tiny_model, tmp_path / "draft", seed=0)
    flags = [w.replace("/ckpt/draft", str(tmp_path / "draft")).replace("tcp://127.0.0.1:5557",
                                                                        f"tcp://127.0.0.1:{free_port()}")
             for w in serve_command()]
    api_key = flags.pop(flags.index("--api-key") + 1)
    flags.remove("--api-key")
    assert api_key == "$KEY"
    flags.pop(flags.index("--worker-extension-cls") + 1)
    flags.remove("--worker-extension-cls")  # the server adds it
    with VLLMServer(tiny_model, ["--dtype", "float32", "--max-model-len", "1024", *flags], api_key="readme-key",
                    log_path=tmp_path / "server.log") as server:
        yield server


def test_the_rl_loop_example_runs(readme_server, tiny_model, tmp_path):
    (example,) = [b for b in fenced_blocks("python") if "update_policy" in b]
    script = (example.replace('"http://127.0.0.1:8000"', repr(readme_server.url))
              .replace('"/ckpt/policy"', repr(str(tiny_model))).replace('"my-key"', '"readme-key"'))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert lines == [f"step {s}: sampled by v{s - 1}, " + lines[s - 1].split(", ", 1)[1] for s in (1, 2, 3)], lines
    status = readme_server.status()
    assert status["versions"]["policy"] == 3 and "num_drafts" in status["spec_decode"], status
    assert status["ineffective_switches"] == []


def test_every_import_the_readme_shows_resolves():
    """The TRL line and the example's imports name what the package has (a rename would break users)."""
    import importlib

    shown = re.findall(r"from (vllm_specrl[\w.]*) import ([\w, ]+)", README)
    assert any(module == "vllm_specrl.integrations.trl" for module, _ in shown)
    for module, names in shown:
        imported = importlib.import_module(module)
        missing = [n.strip() for n in names.split(",") if not hasattr(imported, n.strip())]
        assert not missing, (module, missing)
