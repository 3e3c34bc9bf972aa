"""``vllm-specrl init-draft``, ``export-draft`` and ``import-draft``: EAGLE-3 draft checkpoints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def init(args: argparse.Namespace) -> int:
    from vllm_specrl.proposer.checkpoint import init_draft
    from vllm_specrl.proposer.eagle3_config import DraftConfigError

    aux = tuple(int(i) for i in args.aux_layers.split(",")) if args.aux_layers else None
    try:
        draft = init_draft(args.target, args.out, args.draft_vocab_size, aux, seed=args.seed,
                           target_layer=args.target_layer)
    except DraftConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = draft.config
    print(f"EAGLE-3 draft for {args.target} -> {args.out}: aux layers "
          f"{cfg['eagle_config']['eagle_aux_hidden_state_layer_ids']}, draft vocab "
          f"{cfg['draft_vocab_size']}/{cfg['vocab_size']}, "
          f"{sum(p.numel() for n, p in draft.named_parameters() if not n.startswith('embed'))} "
          "trainable parameters")
    return 0


def convert(args: argparse.Namespace) -> int:
    from vllm_specrl.proposer.checkpoint import convert_draft
    from vllm_specrl.proposer.eagle3_config import SPECRL_ARCH, STOCK_ARCH, DraftConfigError

    arch = STOCK_ARCH if args.command == "export-draft" else SPECRL_ARCH
    try:
        out = convert_draft(args.draft, args.out, arch, args.target)
    except DraftConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.draft} -> {out} ({arch})")
    return 0


def parse_target_layer(value: str) -> int | None:
    """``--target-layer``: ``last`` -> -1, ``none``/``random`` -> None (random weights), else an index."""
    if value in ("none", "random"):
        return None
    if value == "last":
        return -1
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected last, none or a layer index, not {value!r}") from None


def add_target_layer(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--target-layer", type=parse_target_layer, default=parse_target_layer(default),
                        metavar="LAYER",
                        help="start a new draft's decoder layer from this target layer: last, an index (negative "
                             "counts from the end) or none (random weights) "
                             f"(default: {default}; not used with --init-from)")



def add_commands(sub: argparse._SubParsersAction) -> None:
    ini = sub.add_parser("init-draft", help="a fresh EAGLE-3 draft for a Llama/Qwen2/Qwen3 target")
    ini.add_argument("--target", type=Path, required=True, help="target HF checkpoint directory")
    ini.add_argument("--out", type=Path, required=True)
    ini.add_argument("--draft-vocab-size", type=int, default=None,
                     help="reduced draft vocabulary (default: the target's)")
    ini.add_argument("--aux-layers", default="", help="target layer ids, e.g. 2,15,27")
    ini.add_argument("--seed", type=int, default=0)
    add_target_layer(ini, default="none")
    ini.set_defaults(func=init)

    for name, what in (("export-draft", "write a copy plain vLLM eagle3 loads (no plugin)"),
                       ("import-draft", "adopt a speculators/EAGLE/vLLM EAGLE-3 draft")):
        cv = sub.add_parser(name, help=what)
        cv.add_argument("draft", type=Path)
        cv.add_argument("--out", type=Path, required=True)
        cv.add_argument("--target", type=Path, default=None,
                        help="target dir (needed when the draft has no embedding)")
        cv.set_defaults(func=convert)
