"""The ``vllm-specrl`` command: one module per command group (fixtures, drafts, train-draft, engine)."""

from __future__ import annotations

import argparse

from vllm_specrl._version import __version__


def build_parser() -> argparse.ArgumentParser:
    from vllm_specrl.cli import drafts, engine, fixtures, train_draft

    parser = argparse.ArgumentParser(prog="vllm-specrl", description="The ``vllm-specrl`` command.")
    parser.add_argument("--version", action="version", version=f"vllm-specrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (fixtures, drafts, train_draft, engine):
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
