"""docs/architecture.md lists every module of the package under its folder, and names no module that is gone:
a new module is placed on the map when it is added. No engine."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "architecture.md").read_text()


def listed() -> set[str]:
    found, folder = set(), None
    for line in PAGE.splitlines():
        heading = re.match(r"^### `(.+)/`$", line)
        if heading:
            folder = heading.group(1)
        row = re.match(r"^\| `([a-z0-9_]+\.py)` \|", line)
        if row and folder:
            found.add(f"{folder}/{row.group(1)}")
    return found


def modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in (ROOT / "vllm_specrl").rglob("*.py") if "__pycache__" not in p.parts}


def test_every_module_is_on_the_map():
    assert not modules() - listed(), f"modules missing from docs/architecture.md: {sorted(modules() - listed())}"


def test_the_map_names_no_module_that_is_gone():
    gone = sorted(listed() - modules())
    assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"


def test_paths_in_the_narrative_exist():
    narrative = PAGE.split("## Every module", 1)[0]
    paths = set(re.findall(r"`((?:[a-z_]+/)+[a-z0-9_]+\.py)`", narrative))
    assert paths
    missing = [p for p in sorted(paths) if not (ROOT / "vllm_specrl" / p).exists() and not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
