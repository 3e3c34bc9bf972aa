# vllm-specrl on the official vLLM OpenAI server image (CUDA).
#   docker build -t vllm-specrl .
#   docker run --gpus all -p 8000:8000 -v /ckpt:/ckpt vllm-specrl /ckpt/policy --api-key KEY
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
FROM ${VLLM_IMAGE}

COPY pyproject.toml README.md /opt/vllm-specrl/
COPY vllm_specrl /opt/vllm-specrl/vllm_specrl
# No extras: the image already has vllm (CUDA) and torch; [gpu] would only re-resolve them.
RUN pip install --no-cache-dir /opt/vllm-specrl && python -c "import vllm_specrl"

# Endpoint plugins load only when named, and naming any plugin makes
# VLLM_PLUGINS an allowlist for all groups: name both of ours.
ENV VLLM_PLUGINS=specrl,specrl_http
ENTRYPOINT ["vllm", "serve", "--worker-extension-cls", "vllm_specrl.sync.SpecRLWorkerExtension"]
