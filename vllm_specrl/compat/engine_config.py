"""Reads of vLLM's engine, config and worker objects (no patching): what status reports and the
features look up."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any


def process_role() -> str:
    """Which vLLM process this is, from the names vLLM gives its processes."""
    name = multiprocessing.current_process().name
    if name.startswith("EngineCore"):
        return "engine_core"
    if name.startswith("VllmWorker"):
        return "worker"
    return "main"

_SPEC_FIELDS = (
    "method", "model", "num_speculative_tokens", "draft_sample_method",
    "rejection_sample_method", "parallel_drafting", "disable_padded_drafter_batch",
)


def speculative_config_summary(vllm_config: Any) -> dict[str, Any] | None:
    """The speculative config in force, as JSON-safe values (None when off)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    out: dict[str, Any] = {}
    for name in _SPEC_FIELDS:
        if hasattr(spec, name):
            value = getattr(spec, name)
            out[name] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
    return out


def worker_model_summary(worker: Any) -> dict[str, Any]:
    """Class names of the worker's target model and drafter (if any)."""
    runner = getattr(worker, "model_runner", None)
    model = runner.get_model() if runner is not None and hasattr(runner, "get_model") else None
    drafter = runner_drafter(worker)
    draft_model = getattr(drafter, "model", None)
    return {
        "runner": type(runner).__name__ if runner is not None else None,
        "model": type(model).__name__ if model is not None else None,
        "drafter": type(drafter).__name__ if drafter is not None else None,
        "draft_model": type(draft_model).__name__ if draft_model is not None else None,
    }


def draft_and_target_configs(vllm_config: Any) -> tuple[dict[str, Any], dict[str, int]]:
    """The draft's hf config as a dict, and the target's sizes, from a VllmConfig."""
    spec = vllm_config.speculative_config
    hf = spec.draft_model_config.hf_config
    draft = hf.to_dict()
    for key in ("eagle_config", "target_hidden_size", "draft_vocab_size"):
        if getattr(hf, key, None) is not None:
            draft[key] = getattr(hf, key)
    target = vllm_config.model_config
    return draft, {"hidden_size": target.get_hidden_size(), "vocab_size": target.get_vocab_size(),
                   "num_layers": target.get_total_num_hidden_layers()}


def local_checkpoint_dir(model: str | Path, revision: str | None = None, download_dir: str | None = None) -> Path:
    """Where a served model's files are on this host: its directory, or for a hub id (``vllm serve
    Qwen/Qwen3-8B``) the snapshot vLLM downloaded, read from the Hugging Face cache (``download_dir``:
    vLLM's ``--download-dir``), never fetched again."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model), revision=revision, cache_dir=download_dir, local_files_only=True,
                                      allow_patterns=["*.safetensors", "*.json"]))
    except Exception as exc:  # noqa: BLE001 - not a directory and not in the cache: say both
        raise FileNotFoundError(f"{model} is neither a directory nor a model in the Hugging Face cache "
                                f"({download_dir or 'default cache'}): {exc}") from exc


def policy_checkpoint_dir(worker: Any) -> str:
    """The served policy's checkpoint on this host (a directory; a hub id's cached snapshot)."""
    mc = worker.vllm_config.model_config
    load = getattr(worker.vllm_config, "load_config", None)
    return str(local_checkpoint_dir(mc.model, getattr(mc, "revision", None), getattr(load, "download_dir", None)))


def draft_checkpoint_dir(worker: Any) -> str | None:
    """Where the served draft's weights came from: its own directory, or for MTP the policy's."""
    if policy_mtp_drafter(worker) is not None:
        return policy_checkpoint_dir(worker)
    spec = worker.vllm_config.speculative_config
    model = getattr(spec, "model", None) if spec is not None else None
    drafter = runner_drafter(worker)
    if not model or getattr(drafter, "model", None) is None:
        return None
    load = getattr(worker.vllm_config, "load_config", None)
    return str(local_checkpoint_dir(model, getattr(spec, "revision", None), getattr(load, "download_dir", None)))


def is_mtp_tensor(worker: Any, name: str) -> bool:
    """Whether a policy checkpoint tensor belongs to its MTP layers, as the families vLLM serves
    name them: MiMo's ``model.mtp_layers.*``, DeepSeek-style ``model.layers.{i}.*`` with
    ``i >= num_hidden_layers``."""
    if name.startswith("model.mtp_layers."):
        return True
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        hf = worker.vllm_config.model_config.hf_config
        return int(parts[2]) >= int(getattr(hf, "num_hidden_layers", 1 << 30))
    return False


def policy_mtp_drafter(worker: Any) -> Any | None:
    """The drafter model when it is the policy's own MTP layers (``"method": "mtp"``), else None.

    Such a drafter is loaded from the policy checkpoint, and the target's loader
    drops its tensors (``MiMoForCausalLM`` maps ``model.mtp_layers.*`` to None;
    DeepSeek-style bodies skip layers past ``num_hidden_layers``): a policy update
    must reach it separately or it keeps drafting for the old policy.
    """
    spec = worker.vllm_config.speculative_config
    if spec is None or getattr(spec, "method", None) != "mtp":
        return None
    return getattr(runner_drafter(worker), "model", None)


def specrl_additional_config(vllm_config: Any) -> dict[str, Any]:
    """``--additional-config '{"specrl": {...}}'`` (a public, hashed vLLM config field)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return dict(extra.get("specrl", {})) if isinstance(extra, dict) else {}


def runner_drafter(worker: Any) -> Any:
    """The worker's drafter object (None without speculation): the V1 runner's ``drafter``, Model Runner
    V2's ``speculator`` (vLLM 0.32's ``vllm/v1/worker/gpu/model_runner.py``; not run here)."""
    runner = getattr(worker, "model_runner", None)
    drafter = getattr(runner, "drafter", None)
    return drafter if drafter is not None else getattr(runner, "speculator", None)


def data_parallel_rank(worker: Any) -> int:
    """This worker's engine core among a data-parallel server's (0 without data parallelism)."""
    # vLLM resets data_parallel_rank to 0 in each core of a dense model (its ranks are independent);
    # data_parallel_index keeps the core's place.
    parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    return int(getattr(parallel, "data_parallel_index", None) or getattr(parallel, "data_parallel_rank", 0) or 0)
