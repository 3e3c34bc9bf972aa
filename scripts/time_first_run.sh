#!/usr/bin/env bash
# Time a first `make demo` as a newcomer runs it: a fresh clone of this repository, no pip cache, no
# fixtures, no draft. Writes the phases (setup, fixture, draft, demo) to OUT.json, which
# scripts/demo_plan.py reads to tell the next newcomer how long to wait.
# Usage: scripts/time_first_run.sh OUT.json [make variables, e.g. DEMO_DRAFT_ARGS=...]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "$1"); shift
work=$(mktemp -d -t specrl-first-run-XXXX)
git clone -q "$repo" "$work/clone"
cd "$work/clone"
PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 make demo "$@" 2>&1 | awk '{ print strftime("%H:%M:%S"), $0; fflush() }' | tee "$work/demo.log"
python3 scripts/first_run_phases.py "$work/demo.log" --out "$out" --results results/rl_demo.json --make-args "$*" --clone .
echo "log and clone kept in $work"
