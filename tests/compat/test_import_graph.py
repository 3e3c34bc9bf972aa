"""The compatibility layer sits at the bottom of the import graph and stays small: no module of
``vllm_specrl.compat`` imports a feature of the package (at module level or inside a function), and
none is longer than ~400 lines. Read from the source with ``ast``: a planted ``from vllm_specrl.adaptive
import ...`` in any compat module fails it."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_specrl

PACKAGE = Path(vllm_specrl.__file__).parent
COMPAT = PACKAGE / "compat"
MAX_LINES = 400


def imported_modules(path: Path) -> set[str]:
    """Every ``vllm_specrl...`` module a file imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} if node.module != "vllm_specrl" else {f"vllm_specrl.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.add("vllm_specrl.compat" + (f".{node.module}" if node.module else ""))  # relative: inside compat
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {name for name in found if name.startswith("vllm_specrl")}


def test_compat_imports_nothing_above_it():
    offending = {}
    for path in sorted(COMPAT.glob("*.py")):
        above = {m for m in imported_modules(path) if not m.startswith("vllm_specrl.compat")}
        if above:
            offending[path.name] = sorted(above)
    assert not offending, f"compat modules importing features of the package: {offending}"


def test_compat_modules_stay_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in COMPAT.glob("*.py")}
    assert max(sizes.values()) <= MAX_LINES, sizes


def test_the_scan_sees_imports_inside_functions(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from vllm_specrl.adaptive.controller import AdaptiveKController\n")
    assert imported_modules(planted) == {"vllm_specrl.adaptive.controller"}


def test_the_old_catch_all_module_is_gone():
    assert not (PACKAGE / "vllm_compat.py").exists()
