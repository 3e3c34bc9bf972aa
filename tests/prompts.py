"""Deterministic prompts for engine tests: fragments of stdlib source lines."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def code_prompts(n: int, length: int = 48) -> list[str]:
    """``n`` distinct prompts cut from stdlib sources (tests/, not the training corpus order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    prompts: list[str] = []
    seen: set[str] = set()
    for path in sorted(root.glob("*.py"), reverse=True):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for i in range(0, len(lines) - 3, 37):
            text = "\n".join(lines[i : i + 3])[:length]
            if len(text.strip()) > 20 and text not in seen:
                seen.add(text)
                prompts.append(text)
                if len(prompts) == n:
                    return prompts
    raise RuntimeError(f"only {len(prompts)} prompts found")
