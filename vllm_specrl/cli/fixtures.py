"""``vllm-specrl fixtures`` and ``check-fixtures``: the local models the tests, demo and benchmarks use."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build(args: argparse.Namespace) -> int:
    from vllm_specrl.fixtures import FIXTURE_NAMES, FixtureError, build_fixtures, read_manifest

    names = tuple(n.strip() for n in args.only.split(",")) if args.only else FIXTURE_NAMES
    try:
        built = build_fixtures(args.out, names, force=args.force)
    except FixtureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, path in built.items():
        manifest = read_manifest(path, verify_hashes=False)
        print(f"{name}: {path} {json.dumps(manifest.metrics)}")
    return 0


def check(args: argparse.Namespace) -> int:
    from vllm_specrl.fixtures import FIXTURE_NAMES, FixtureError, read_manifest, target_dir

    names = tuple(n.strip() for n in args.only.split(",")) if args.only else FIXTURE_NAMES
    ok = True
    for name in names:
        try:
            read_manifest(target_dir(args.out, name))
            print(f"{name}: ok")
        except FixtureError as exc:
            ok = False
            print(f"{name}: {exc}", file=sys.stderr)
    return 0 if ok else 2



def add_commands(sub: argparse._SubParsersAction) -> None:
    from vllm_specrl.fixtures import default_root

    fx = sub.add_parser("fixtures", help="build the local fixture models (cached, deterministic)")
    fx.add_argument("--out", type=Path, default=default_root(), help="fixture root directory")
    fx.add_argument("--only", default="", help="comma-separated subset: tiny,real")
    fx.add_argument("--force", action="store_true", help="rebuild even if a valid cache exists")
    fx.set_defaults(func=build)

    ck = sub.add_parser("check-fixtures", help="verify fixture directories against their manifests")
    ck.add_argument("--out", type=Path, default=default_root())
    ck.add_argument("--only", default="")
    ck.set_defaults(func=check)
