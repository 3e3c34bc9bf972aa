#!/usr/bin/env bash
# Build arctic-inference (vLLM's `suffix` speculative method) from its source distribution on a
# CPU machine and install it into its own directory, for scripts/bench/bench_history.py --arctic-site DIR.
# Only the suffix-tree extension is compiled (its CUDA ops are opt-in). It is kept off the venv's
# path because it registers a vLLM general plugin that patches vLLM when loaded.
set -euo pipefail
OUT=${1:-.arctic}
PY=${PY:-.venv/bin/python}
case $PY in /*) ;; *) PY="$PWD/$PY" ;; esac  # absolute, symlink kept: the venv's python
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip install -q --target "$WORK/tools" cmake ninja nanobind==2.9.2 setuptools wheel
"$PY" -m pip download -q --no-deps arctic-inference==0.3.0 -d "$WORK/src"
tar xzf "$WORK"/src/arctic_inference-*.tar.gz -C "$WORK"
(cd "$WORK"/arctic_inference-0.3.0 && PATH="$WORK/tools/bin:$PATH" PYTHONPATH="$WORK/tools" \
  CMAKE_BUILD_PARALLEL_LEVEL=1 "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/whl" .)
"$PY" -m pip install -q --no-deps --target "$OUT" "$WORK"/whl/arctic_inference-*.whl
echo "arctic-inference installed in $OUT: python scripts/bench/bench_history.py --methods plain,suffix --arctic-site $OUT"
