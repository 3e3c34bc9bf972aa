"""vLLM's source checked for every touch point of a registry: functions' parameters, classes' methods
and attributes, module names, read with ``ast`` (so a vLLM that cannot run here, a CUDA wheel of a
later release, can be checked too), and each patch's signature against what it installs over."""

from __future__ import annotations

import ast
import atexit
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_specrl.compat.registry import Registry


@dataclass
class Found:
    status: str            # "ok" or "missing"
    signature: list[str]   # parameters, methods or attributes found (sorted where a set)


def parse(root: Path, rel: str) -> ast.Module | None:
    path = root / "vllm" / rel
    return ast.parse(path.read_text()) if path.exists() else None


def find(tree: ast.AST, dotted: str) -> ast.AST | None:
    node: ast.AST | None = tree
    for part in dotted.split("."):
        body = getattr(node, "body", [])
        node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
        if node is None:
            return None
    return node


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names; ``name=`` where it has a default."""
    a = fn.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    out = [p.arg + ("=" if i >= first_default else "") for i, p in enumerate(positional)]
    out += [f"*{a.vararg.arg}"] if a.vararg else []
    out += [f"{p.arg}=" if d is not None else p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    out += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return out


def class_attrs(cls: ast.ClassDef) -> set[str]:
    names = {t.target.id for t in cls.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
    names |= {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}  # properties
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    names.add(el.attr)
    if any(isinstance(b, ast.Name) and b.id == "NamedTuple" for b in cls.bases):
        names |= {t.target.id for t in cls.body if isinstance(t, ast.AnnAssign)}
    return names


def check(root: Path, rel: str, dotted: str, kind: str) -> Found:
    tree = parse(root, rel)
    if tree is None:
        return Found("missing", [f"no file vllm/{rel}"])
    if kind.startswith("names:"):
        defined = {t.id for n in tree.body for t in (n.targets if isinstance(n, ast.Assign) else
                   [n.target] if isinstance(n, ast.AnnAssign) else []) if isinstance(t, ast.Name)}
        defined |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        wanted = kind.split(":", 1)[1].split(",")
        missing = [w for w in wanted if w not in defined]
        return Found("missing" if missing else "ok", sorted(set(wanted) - set(missing)))
    if kind == "method-anywhere":
        hits = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.name == dotted]
        return Found("ok", params(hits[0])) if hits else Found("missing", [])
    node = find(tree, dotted)
    if node is None:
        return Found("missing", [])
    if kind == "function":
        return Found("ok", params(node))
    if kind == "class":
        return Found("ok", sorted(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))))
    wanted = kind.split(":", 1)[1].split(",")
    have = class_attrs(node)
    missing = [w for w in wanted if w not in have]
    return Found("missing" if missing else "ok", sorted(set(wanted) - set(missing)))


def source_root(wheel: Path | None, tree: Path | None) -> tuple[Path, str]:
    if tree:
        return tree, "source tree"
    if wheel:
        out = Path(tempfile.mkdtemp(prefix="vllm-src-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    zf.extract(name, out)
        return out, wheel.name
    import vllm

    return Path(vllm.__file__).parents[1], f"installed {vllm.__version__}"


def version_of(root: Path) -> str:
    path = root / "vllm" / "_version.py"
    found = re.search(r"""^__version__\s*=.*?['"]([^'"]+)['"]""", path.read_text() if path.exists() else "", re.M)
    return found.group(1) if found else "unknown"


def patch_signatures(registry: Registry) -> dict[tuple[str, str], list[tuple[str, tuple[tuple[str, ...], ...]]]]:
    """(file, dotted name) -> [(patch name, the signatures it installs over)] for patches that check one."""
    out: dict[tuple[str, str], list] = {}
    for patch in registry.patches():
        if patch.signature is not None:
            point = patch.touch_point()
            out.setdefault((point.file, point.name), []).append((patch.name, (patch.signature, *patch.also_checked)))
    return out


def skipped_patches(found: list[str], accepted: list[tuple[str, tuple[tuple[str, ...], ...]]]) -> list[str]:
    """The patches that would skip over a function with parameters ``found`` (signature drift)."""
    names = tuple(p.rstrip("=").lstrip("*") for p in found)
    skipped = []
    for patch, signatures in accepted:
        # A patch on one runner object sees its bound method: no ``self``.
        if not any(names == sig or (names[:1] == ("self",) and names[1:] == sig) for sig in signatures):
            skipped.append(patch)
    return skipped



def runner_of_source(root: Path) -> str:
    """The model runner a vLLM source tree serves speculators with: ``mrv2`` where it has Model Runner V2's
    registry of speculative methods (vLLM >= 0.34), else ``v1``."""
    tree = parse(root, "v1/worker/gpu/spec_decode/speculator_config.py")
    return "mrv2" if tree is not None and find(tree, "register_speculative_method") is not None else "v1"


def compare(registry: Registry, ref_root: Path, new_root: Path,
            runner: str | None = None) -> tuple[list[dict[str, Any]], int]:
    """One row per touch point of ``registry`` that the source at ``new_root`` must hold (those of its model
    runner, ``runner_of_source`` unless given), against the one at ``ref_root`` (same / extended / changed /
    missing / patch skips); and how many of them fail. A function with ``signatures`` is held to them."""
    rows, failures = [], 0
    accepted = patch_signatures(registry)
    runner = runner or runner_of_source(new_root)
    for point in registry.touch_points(runner):
        rel, dotted, kind, used_for = point.file, point.name, point.kind, point.used_for
        ref, new = check(ref_root, rel, dotted, kind), check(new_root, rel, dotted, kind)
        skipped = skipped_patches(new.signature, accepted.get((rel, dotted), [])) if new.status == "ok" else []
        if new.status == "missing":
            verdict = "missing"
        elif skipped:
            verdict = f"patch skips: {', '.join(skipped)}"
        elif kind == "function" and (rel, dotted) in accepted and new.signature != ref.signature:
            verdict = "same (a signature its patches were written for)"
        elif point.signatures and kind == "function":
            verdict = "same (a signature it was written for)" if tuple(new.signature) in point.signatures \
                else "changed"
        elif ref.status == "ok" and kind == "function" and new.signature != ref.signature:
            added = new.signature[len(ref.signature):]
            extended = new.signature[:len(ref.signature)] == ref.signature and all(p.endswith("=") for p in added)
            verdict = "extended (defaulted params)" if extended else "changed"
        else:
            verdict = "same" if new.signature == ref.signature else "same (touched names present)"
        failures += verdict in ("missing", "changed") or verdict.startswith("patch skips")
        rows.append({"file": f"vllm/{rel}", "name": dotted or kind, "kind": kind.split(":")[0], "used_for": used_for,
                     "runner": point.runner,
                     "verdict": verdict, "reference": ref.signature if kind == "function" else None,
                     "checked": new.signature if kind == "function" or new.status == "missing" else None})
    return rows, failures
