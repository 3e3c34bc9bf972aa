"""The ``specrl_shm`` and ``specrl_gloo`` weight-transfer backends, registered with vLLM's factory by path (a public
extension point: nothing of the engine is imported until vLLM builds one)."""

from __future__ import annotations

SHM_BACKEND = "specrl_shm"


def register_shm_weight_transfer_backend() -> str:
    """Register ``specrl_shm`` in vLLM's ``WeightTransferEngineFactory``."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if SHM_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            SHM_BACKEND, "vllm_specrl.sync.backends.shm_backend", "SpecRLShmWeightTransferEngine")
    return SHM_BACKEND


GLOO_BACKEND = "specrl_gloo"


def register_gloo_weight_transfer_backend() -> str:
    """Register ``specrl_gloo`` in vLLM's worker and trainer factories (one trainer rank broadcasting to
    every worker of every engine over gloo)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            GLOO_BACKEND, "vllm_specrl.sync.backends.gloo_backend", "SpecRLGlooWeightTransferEngine")
    if GLOO_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            GLOO_BACKEND, "vllm_specrl.sync.backends.gloo_backend", "SpecRLGlooTrainerWeightTransferEngine")
    return GLOO_BACKEND
