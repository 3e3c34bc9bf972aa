"""The ``specrl_shm`` weight-transfer backend, registered with vLLM's factory by path (a public
extension point: nothing of the engine is imported until vLLM builds one)."""

from __future__ import annotations

SHM_BACKEND = "specrl_shm"


def register_shm_weight_transfer_backend() -> str:
    """Register ``specrl_shm`` in vLLM's ``WeightTransferEngineFactory``."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if SHM_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            SHM_BACKEND, "vllm_specrl.sync.shm_engine", "SpecRLShmWeightTransferEngine")
    return SHM_BACKEND
