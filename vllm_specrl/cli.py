"""The ``vllm-specrl`` command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_specrl._version import __version__


def _cmd_fixtures(args: argparse.Namespace) -> int:
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


def _cmd_check_fixtures(args: argparse.Namespace) -> int:
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


def _cmd_status(args: argparse.Namespace) -> int:
    import requests

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    resp = requests.get(args.engine.rstrip("/") + "/specrl/status", headers=headers, timeout=30)
    if resp.status_code != 200:
        print(f"error: HTTP {resp.status_code}: {resp.text}", file=sys.stderr)
        return 1
    print(json.dumps(resp.json(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from vllm_specrl.fixtures import default_root

    parser = argparse.ArgumentParser(prog="vllm-specrl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"vllm-specrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    fx = sub.add_parser("fixtures", help="build the local fixture models (cached, deterministic)")
    fx.add_argument("--out", type=Path, default=default_root(), help="fixture root directory")
    fx.add_argument("--only", default="", help="comma-separated subset: tiny,real")
    fx.add_argument("--force", action="store_true", help="rebuild even if a valid cache exists")
    fx.set_defaults(func=_cmd_fixtures)

    ck = sub.add_parser("check-fixtures", help="verify fixture directories against their manifests")
    ck.add_argument("--out", type=Path, default=default_root())
    ck.add_argument("--only", default="")
    ck.set_defaults(func=_cmd_check_fixtures)

    st = sub.add_parser("status", help="print /specrl/status of a running vllm serve")
    st.add_argument("--engine", default="http://127.0.0.1:8000")
    st.add_argument("--api-key", default=None)
    st.set_defaults(func=_cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
