"""Weight-transfer backend ``specrl_gloo``: one trainer rank broadcasts each tensor once to every worker of
every engine, over ``torch.distributed``'s gloo backend, so the one-to-many pattern runs on CPU too.

It follows the protocol of vLLM's ``nccl`` engine (trainer rank 0 in a group with every inference worker;
per round, ``update_weights`` carries the names, dtypes and shapes and runs while the trainer
broadcasts) with one difference: the workers stage what they receive, validate it (names, shapes,
dtypes, finite values, ``d2t``/``t2d`` ranges) and apply nothing until ``finish_weight_update``. A
worker that refuses still receives the whole round (the broadcast is a collective), then raises; the
trainer side (``EngineGroup``) then aborts the round on every other engine before any applies, so an
update lands on all engines or on none.

Worker side: ``--weight-transfer-config '{"backend": "specrl_gloo"}'``. Trainer side:
``WeightTransferTrainerFactory.trainer_init(GlooTrainerInitInfo(...), client=EngineGroup([...]),
source=ModuleSource(model))`` and ``send_weights(weight_version=...)``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    WeightSource,
)

from vllm_specrl import faults
from vllm_specrl.sync.backends.staged import StagingWeightTransferEngine
from vllm_specrl.sync.worker.validate import tensor_problems

BACKEND_NAME = "specrl_gloo"


def gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """A gloo process group of its own (no global ``torch.distributed`` state touched)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(address, port, rank, world_size, "gloo",
                                                          timeout=timedelta(seconds=timeout_s))


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """From the group's rank 0 to every other rank (in place on receivers)."""
    import torch.distributed as dist

    group.broadcast([tensor], dist.BroadcastOptions()).wait()


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    abort: bool = False  # another engine refused this round: drop what was staged, apply nothing


class SpecRLGlooWeightTransferEngine(StagingWeightTransferEngine,
                                     WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The inference worker's side: receive, stage, validate; apply at ``finish_weight_update``."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group, self.rounds = None, 0  # rounds: this engine's, for failpoints

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.group = gloo_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                init_info.timeout_s)
        self.staged = None

    def start_weight_update(self) -> None:
        super().start_weight_update()
        self.rounds += 1

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.aborted(update_info):
            return
        if self.group is None:
            raise RuntimeError("specrl_gloo: init_weight_transfer_engine first")
        specs, problems, staged = self.target_specs(), [], {}
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            broadcast(self.group, tensor)  # every rank takes every tensor, refused or not: a collective
            problems.extend(tensor_problems(name, tensor, specs))
            staged[name] = tensor
        target = "policy" if self.model is self._default_model else "draft"
        if (faults.armed_fault(target, self.rounds, self.parallel_config.rank) or ("",))[0] == "refuse":
            problems.append(f"injected refusal ({faults.FAULTS_ENV}): {target} round {self.rounds}")
        self.stage(staged, problems, "specrl_gloo: update refused")

    def shutdown(self) -> None:
        super().shutdown()
        self.group = None


class TensorSource(WeightSource):
    """A ``WeightSource`` over named tensors (a checkpoint's, a draft's), where vLLM's ``ModuleSource``
    takes a module."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

    def __iter__(self):
        return iter(self.tensors.items())


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: ``world_size`` is 1 + every engine's workers (``EngineGroup.workers``)."""

    backend: ClassVar[str] = BACKEND_NAME

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 600.0


class SpecRLGlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Rank 0 of the group: drives the round through ``client`` and broadcasts each tensor once."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> SpecRLGlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("specrl_gloo: the trainer engine needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker_init = asdict(GlooInitInfo(init_info.master_address, init_info.master_port, 1,
                                          init_info.world_size, init_info.timeout_s))
        with ThreadPoolExecutor(1) as pool:  # the workers join while rank 0 opens the group
            joined = pool.submit(client.init_weight_transfer_engine, worker_init)
            engine.group = gloo_group(init_info.master_address, init_info.master_port, 0, init_info.world_size,
                                      init_info.timeout_s)
            joined.result()
        return engine

    def send_weights(self, weight_version: str | None = None, draft: bool = False) -> None:
        """One round: start, broadcast every tensor while the engines receive and validate, then finish
        (every engine applies) or, if any refused, nothing anywhere (``EngineGroup`` aborts the rest)."""
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        info = asdict(GlooUpdateInfo([m.name for m in meta], [str(m.dtype).split(".")[-1] for m in meta],
                                     [list(m.shape) for m in meta]))
        (self.client.start_draft_weight_update if draft else self.client.start_weight_update)()
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(self.client.update_weights, info)
            for (name, tensor), expected in zip(self.source, meta):
                if name != expected.name:
                    raise ValueError(f"WeightSource yielded {name!r} where metadata() declared {expected.name!r}")
                broadcast(self.group, tensor.detach().to("cpu").contiguous())
            received.result()  # a refusal anywhere raises here, the round aborted everywhere
        self.client.finish_weight_update(weight_version)

    def shutdown(self) -> None:
        self.group = None
