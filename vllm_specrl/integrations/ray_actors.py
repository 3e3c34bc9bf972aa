"""Engine replicas as Ray actors, the layout RL frameworks use, with the plugin inside each.

vLLM's CPU build cannot run its own Ray executor (``initialize_ray_cluster``: "current platform cpu
does not support ray"; ``scripts/repro/repro_cpu_ray_executor.py``), so on CPU each replica is a whole
engine inside one actor: ``EngineActor`` holds an in-process ``vllm.LLM`` with the worker extension
and exposes generation, status and vLLM's native weight-transfer calls. ``RayEngineClient`` is the
trainer's ``VLLMWeightSyncClient`` for one such actor (draft rounds included), so an ``EngineGroup`` of
them broadcasts a policy to every replica once over ``specrl_gloo``:

    EngineReplica = ray.remote(EngineActor)
    replicas = [EngineReplica.remote(model, llm_kwargs) for _ in range(2)]
    group = EngineGroup([RayEngineClient(r) for r in replicas])
"""

from __future__ import annotations

import os
from typing import Any


class EngineActor:
    """One engine replica (wrap with ``ray.remote``). ``llm_kwargs`` go to ``vllm.LLM``; the worker
    extension is added, and ``--weight-transfer-config`` defaults to ``specrl_gloo``."""

    def __init__(self, model: str, llm_kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None):
        os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})})
        from vllm import LLM

        kwargs = {"weight_transfer_config": {"backend": "specrl_gloo"},
                  "worker_extension_cls": "vllm_specrl.sync.SpecRLWorkerExtension",
                  "disable_log_stats": False, **(llm_kwargs or {})}  # status reads the spec-decode counters
        self.llm = LLM(model=model, **kwargs)

    def generate(self, prompts: list[str], sampling: dict[str, Any]) -> list[list[list[int]]]:
        """Token ids of each prompt's samples (``sampling``: ``SamplingParams`` fields)."""
        from vllm import SamplingParams

        outs = self.llm.generate(prompts, SamplingParams(**sampling), use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    def status(self) -> dict[str, Any]:
        """Each worker's ``specrl_status`` (versions, watch, capture, plugin) and vLLM's spec-decode counters."""
        from vllm_specrl import metrics

        return {"workers": self.llm.collective_rpc("specrl_status"),
                "spec_decode": metrics.from_llm_metrics(self.llm.get_metrics()).summary()}

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return self.llm.collective_rpc(method, args=args)

    # vLLM's native weight-transfer API, as the trainer's client calls it
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info: dict | list) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)


class RayEngineClient:
    """``VLLMWeightSyncClient`` over one ``EngineActor`` handle (each call waits for the actor)."""

    def __init__(self, handle: Any):
        self.handle = handle

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.handle, method).remote(*args))

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def start_draft_weight_update(self) -> None:
        self._call("start_draft_weight_update")

    def update_weights(self, update_info: dict | list) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)
