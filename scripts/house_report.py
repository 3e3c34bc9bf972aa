"""What a newcomer meets in the tree, counted: files per package folder, the largest modules and functions,
the switches a GPU user reads, the test programs written in f-strings, long lines. Run before and after a
layout change to say what it changed.

    python scripts/house_report.py [--json out.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_specrl"
LONG_FUNCTION = 80  # lines


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def files_per_folder() -> dict[str, int]:
    return dict(sorted(Counter(str(p.parent.relative_to(ROOT)) for p in python_files(PACKAGE)).items()))


def functions(paths: list[Path]) -> list[tuple[int, str]]:
    """(lines, "path:qualified name") for every function."""
    out = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        stack: list[tuple[ast.AST, str]] = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        out.append((child.end_lineno - child.lineno + 1, f"{path.relative_to(ROOT)}:{name}"))
                    stack.append((child, name + "."))
    return sorted(out, reverse=True)


def fstring_test_programs() -> int:
    """Engine tests written as programs in strings: calls of the suite's ``run_python`` helper."""
    return sum(len(re.findall(r"\brun_python\(", p.read_text())) for p in python_files(ROOT / "tests")
               if p.name != "helpers.py")


def long_lines(limit: int = 120) -> int:
    return sum(1 for p in python_files(PACKAGE) for line in p.read_text().splitlines() if len(line) > limit)


def switches() -> dict[str, int]:
    sys.path.insert(0, str(ROOT))
    from vllm_specrl import switches as sw

    everything = sw.SWITCHES
    cpu = [s.name for s in everything if "CPU" in s.default or "_CPU_" in s.name or s.name.endswith("MALLOC_TUNING")]
    return {"all": len(everything), "cpu": len(cpu), "cpu_names": cpu}


def report() -> dict:
    package = python_files(PACKAGE)
    modules = sorted(((len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in package), reverse=True)
    funcs = functions(package)
    scripts = functions(python_files(ROOT / "scripts"))
    return {
        "package_lines": sum(n for n, _ in modules), "package_modules": len(modules),
        "files_per_folder": files_per_folder(),
        "largest_modules": modules[:10],
        "package_functions_over_80_lines": [f for f in funcs if f[0] > LONG_FUNCTION],
        "script_functions_over_80_lines": len([f for f in scripts if f[0] > LONG_FUNCTION]),
        "tests_root_files": len([p for p in (ROOT / "tests").glob("*.py")]),
        "fstring_test_programs": fstring_test_programs(),
        "package_lines_over_120": long_lines(),
        "switches": switches(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    r = report()
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
