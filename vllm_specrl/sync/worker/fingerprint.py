"""A cheap fingerprint of the weights the drafter serves, as it serves them.

The draft's parameters cannot simply be hashed: on CPU vLLM repacks every Linear layer's weight for
oneDNN after loading, and the parameter left behind is empty. So each Linear layer is fingerprinted by
what it computes: its own ``quant_method.apply`` on a fixed probe row (one matrix-vector product per
layer), and every other parameter and buffer by its bytes. Weights the draft shares with the target
(an embedding, an LM head) are left out: a policy update changes them legitimately. Deterministic on
one machine, so equal weights give an equal fingerprint; any changed weight changes it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from vllm_specrl.compat import engine_config

PROBE_SEED = 20261129


def _probe(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(PROBE_SEED + width)
    return torch.randn(1, width, generator=generator).to(device=device, dtype=dtype)


def _linear_output(module: Any) -> torch.Tensor | None:
    """A Linear layer's output on the probe row, through its own (possibly repacked) kernel."""
    method = getattr(module, "quant_method", None)
    weight = getattr(module, "weight", None)
    width = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
    if method is None or weight is None or not width or not hasattr(method, "apply"):
        return None
    try:
        return method.apply(module, _probe(int(width), weight.dtype, weight.device))
    except Exception:  # noqa: BLE001 - a layer this probe cannot drive: its bytes are hashed instead
        return None


@torch.no_grad()
def model_fingerprint(model: Any, exclude: set[int] = frozenset()) -> str:
    """sha256 over each module's probe output (Linear layers) or its parameters' and buffers' bytes;
    tensors whose storage is in ``exclude`` (shared with another model) are skipped."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        own = [(n, t) for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
               if t is not None and t.numel() and t.data_ptr() not in exclude]
        weight = getattr(module, "weight", None)
        out = _linear_output(module) if weight is None or weight.data_ptr() not in exclude else None
        if out is not None:
            digest.update(f"{name}:probe".encode())
            digest.update(out.detach().float().cpu().numpy().tobytes())
            own = [(n, t) for n, t in own if n != "weight"]
        for tensor_name, tensor in own:
            digest.update(f"{name}.{tensor_name}".encode())
            digest.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()
                          if tensor.dtype != torch.bool else tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def draft_fingerprint(worker: Any) -> str | None:
    """The drafter's fingerprint on this worker (None without a draft model)."""
    drafter = engine_config.runner_drafter(worker)
    draft = getattr(drafter, "model", None)
    if draft is None:
        return None
    target = worker.model_runner.get_model()
    shared = {t.data_ptr() for t in [*target.parameters(), *target.buffers()] if t.numel()}
    return model_fingerprint(draft, shared)
