"""vLLM weight-transfer backend ``specrl_shm``: vLLM's native four-phase API on CPU.

vLLM 0.32's ``nccl`` and ``ipc`` engines are CUDA-only. This backend moves
chunks through shared memory (safetensors files on /dev/shm, as
``vllm_specrl.sync.shm`` writes them) and loads them with vLLM's layerwise
in-place reload, so ``--weight-transfer-config '{"backend":"specrl_shm"}'``
makes ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights({"paths": [...]})`` / ``finish_weight_update`` work on CPU
(offline ``LLM`` or the dev-mode HTTP routes). Each chunk is validated before
it is loaded; unlike ``/specrl/update`` the native protocol applies chunks as
they come, so it is not atomic across chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vllm_specrl.sync import reload
from vllm_specrl.security import confined_file
from vllm_specrl.sync.shm import SHM_DIR
from vllm_specrl.sync.validate import WeightUpdateError, checkpoint_specs, tensor_problems

BACKEND_NAME = "specrl_shm"


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    paths: list[str] = field(default_factory=list)


class SpecRLShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = True

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self._specs: dict[str, dict] = {}

    def _checkpoint_specs(self) -> dict:
        directory = str(self.model_config.model)
        if directory not in self._specs:
            self._specs[directory] = checkpoint_specs(directory)
        return self._specs[directory]

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        specs = self._checkpoint_specs()
        for path in update_info.paths:
            try:
                path = confined_file(path, SHM_DIR, "specrl-", ".safetensors")
            except ValueError as exc:
                raise WeightUpdateError(str(exc)) from None
            tensors = load_file(path)
            problems = [p for name, t in tensors.items() for p in tensor_problems(name, t, specs)]
            if problems:
                raise WeightUpdateError(f"chunk {path} rejected", problems)
            self.model.load_weights(weights=tensors.items())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        reload.refresh_tied_lm_head(self.model)

    def shutdown(self) -> None:
        self._specs = {}
