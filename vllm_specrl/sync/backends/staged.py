"""What the plugin's weight-transfer backends (``specrl_shm``, ``specrl_gloo``) share: every chunk is
validated against the served checkpoint (the draft's own during a draft session) and staged; nothing is
applied until ``finish_weight_update``, so a refused chunk, or a round another engine refused
(``abort``, sent by ``EngineGroup``), leaves the engine serving what it served."""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine

from vllm_specrl.sync.worker import reload
from vllm_specrl.sync.worker.validate import WeightUpdateError, checkpoint_specs


class StagingWeightTransferEngine(WeightTransferEngine):
    supports_draft_weight_update = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.staged: dict | None = None
        self._specs: dict[str, dict] = {}

    def target_specs(self) -> dict:
        """Names, shapes and dtypes of the checkpoint this session loads into (headers only, cached)."""
        directory = str(self.model_config.model)  # the draft's own config during a draft session
        if directory not in self._specs:
            self._specs[directory] = checkpoint_specs(directory)
        return self._specs[directory]

    def start_weight_update(self) -> None:
        self.staged = {}

    def aborted(self, update_info: Any) -> bool:
        """An ``abort`` round: what was staged is dropped."""
        if update_info.abort:
            self.staged = None
        return update_info.abort

    def stage(self, tensors: dict, problems: list[str], refusal: str) -> None:
        """Keep ``tensors`` for the finish, or, with any problem, drop the whole round and refuse it."""
        if problems:
            self.staged = None
            raise WeightUpdateError(f"{refusal}, nothing applied", problems)
        self.staged = {**(self.staged or {}), **tensors}

    def finish_weight_update(self) -> None:
        staged, self.staged = self.staged, None
        if staged:  # nothing when aborted or nothing was sent
            reload.apply_staged(self.model, self.model_config, staged)

    def shutdown(self) -> None:
        self.staged = None
