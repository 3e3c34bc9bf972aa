#!/usr/bin/env bash
# Check the package against a vLLM release that cannot run here, before any user installs it beside one:
#   1. its source, touch point by touch point (scripts/check_vllm_touch_points.py --wheel), written to
#      docs/vllm_<VERSION>_touch_points.json;
#   2. an import-only environment: the release's Python (its wheel without dependencies: the compiled
#      kernels and CUDA libraries stay out), its pure-Python requirements, a CPU torch and this package;
#      there the plugin loads and vLLM's own SpeculativeConfig resolves the package's methods
#      (scripts/check_vllm_import.py). Nothing runs an engine.
# Usage: bash scripts/check_vllm_import.sh 0.34.0 [ENV_DIR]   (make check-vllm VERSION=0.34.0)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: check_vllm_import.sh VERSION [ENV_DIR]}
ENV=${2:-.vllm-$VERSION}
VENV=${VENV:-.venv}
WHEELS="$ENV/wheels"
PIP="$ENV/bin/pip --disable-pip-version-check -q"
quiet() { grep --line-buffered -v -e "^WARNING: Location" -e "^Requirement already satisfied" || true; }

mkdir -p "$WHEELS"
if ! ls "$WHEELS"/vllm-"$VERSION"-*.whl >/dev/null 2>&1; then
  echo "[check-vllm] downloading the vLLM $VERSION wheel (no dependencies)"
  "$VENV/bin/pip" download --disable-pip-version-check -q --no-deps "vllm==$VERSION" -d "$WHEELS" 2>&1 | quiet
fi
WHEEL=$(ls "$WHEELS"/vllm-"$VERSION"-*.whl | head -1)
echo "[check-vllm] 1/2 touch points of $WHEEL"
"$VENV/bin/python" scripts/check_vllm_touch_points.py --wheel "$WHEEL" --out "docs/vllm_${VERSION}_touch_points.json" \
  | tail -1

if [ ! -x "$ENV/bin/python" ]; then
  python3 -m venv "$ENV"
fi
TORCH=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
# The release's requirements, less what only its compiled GPU code needs (kernels, CUDA libraries, media).
unzip -p "$WHEEL" "vllm-$VERSION.dist-info/METADATA" | sed -n 's/^Requires-Dist: //p' | grep -v "extra ==" \
  | grep -v -i -E "^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer|apache-tvm|tilelang|nvidia|nvtx|fastsafetensors|instanttensor|quack|tokenspeed|humming|numba|xformers|triton)" \
  > "$ENV/requirements.txt"
echo "[check-vllm] 2/2 import-only environment in $ENV (vLLM $VERSION's Python, torch $TORCH, no compiled kernels)"
$PIP install "torch==$TORCH" 2>&1 | quiet
$PIP install --no-deps "$WHEEL" 2>&1 | quiet
$PIP install -r "$ENV/requirements.txt" 2>&1 | quiet
$PIP install --no-deps -e . 2>&1 | quiet
"$ENV/bin/python" scripts/check_vllm_import.py --fixtures "${FIXTURES:-.fixtures}" --out "$ENV/import_check.json" 2>&1 \
  | grep -e "^ok" -e "^FAIL" -e "^{"
