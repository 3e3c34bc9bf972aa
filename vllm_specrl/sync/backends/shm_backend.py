"""vLLM weight-transfer backend ``specrl_shm``: vLLM's native four-phase API on CPU.

vLLM 0.32's ``nccl`` and ``ipc`` engines are CUDA-only. This backend moves
chunks through shared memory (safetensors files on /dev/shm, as
``vllm_specrl.sync.shm`` writes them) and loads them with vLLM's layerwise
in-place reload, so ``--weight-transfer-config '{"backend":"specrl_shm"}'``
makes ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights({"paths": [...]})`` / ``finish_weight_update`` work on CPU
(offline ``LLM`` or the dev-mode HTTP routes). Every chunk is validated and staged as it
arrives; nothing is applied until ``finish_weight_update``, so a refused chunk leaves the
engine serving what it served (an update is whole or not at all, as on ``/specrl/update``;
``EngineGroup`` extends that across engines).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from vllm_specrl.security import confined_file
from vllm_specrl.sync.shm import SHM_DIR
from vllm_specrl.sync.backends.staged import StagingWeightTransferEngine
from vllm_specrl.sync.worker.validate import WeightUpdateError, tensor_problems

BACKEND_NAME = "specrl_shm"


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    paths: list[str] = field(default_factory=list)
    abort: bool = False


class SpecRLShmWeightTransferEngine(StagingWeightTransferEngine, WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        pass  # nothing to connect: the chunks are files

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        if self.aborted(update_info):
            return
        specs = self.target_specs()
        for path in update_info.paths:
            try:
                path = confined_file(path, SHM_DIR, "specrl-", ".safetensors")
            except ValueError as exc:
                self.staged = None
                raise WeightUpdateError(str(exc)) from None
            tensors = load_file(path)
            self.stage(tensors, [p for name, t in tensors.items() for p in tensor_problems(name, t, specs)],
                       f"chunk {path} rejected")
