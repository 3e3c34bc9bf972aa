"""TRL adapter: ``GRPOTrainer`` (and TRL's other vLLM-backed trainers) roll out through vllm-specrl.

Why TRL: of the RL frameworks installable beside vLLM here, its vLLM
integration is the cleanest to hook. In server mode it generates through a
plain ``vllm serve`` on the OpenAI ``/v1/completions`` route (token ids and
logprobs), and every other thing it asks of the server goes through one
class, ``trl.generation.vllm_client.VLLMClient``. Upstream that class syncs
weights over vLLM's NCCL weight-transfer engine (CUDA only, dev-mode routes).
``SpecRLVLLMClient`` keeps TRL's generation as it is — so speculative
decoding, capture and the online draft trainer work unchanged behind it — and
replaces the weight path with :class:`vllm_specrl.EngineClient`: shared memory
or HTTP, validated before any byte is applied, versioned, on CPU or GPU.

    from vllm_specrl.integrations.trl import use_specrl
    use_specrl()                      # before the trainer is built
    trainer = GRPOTrainer(model=..., reward_funcs=..., train_dataset=...,
                          args=GRPOConfig(use_vllm=True, vllm_mode="server",
                                          vllm_server_base_url="http://127.0.0.1:8000"))

Checked against TRL 1.16.0 (``VLLMClient`` API: ``init_communicator``,
``weight_update``, ``update_named_param(s)``, ``update_model_params``,
``reset_prefix_cache``, ``get_server_info``, ``close_communicator``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vllm_specrl.sync.clients.response_check import API_KEY_ENV
from vllm_specrl.sync.clients.engine_client import EngineClient

try:
    from trl.generation import vllm_client as _trl_vllm_client
    from trl.generation import vllm_generation as _trl_vllm_generation
except ImportError as exc:  # pragma: no cover - depends on the user's environment
    raise ImportError("vllm_specrl.integrations.trl needs TRL >= 1.16 (pip install 'vllm-specrl[trl]')") from exc


class SpecRLVLLMClient(_trl_vllm_client.VLLMClient):
    """TRL's ``VLLMClient`` with weight sync through vllm-specrl instead of NCCL.

    Tensors TRL streams (one ``update_named_params`` call per sync, or single
    ``update_named_param`` calls) are collected and pushed as one versioned,
    all-or-nothing policy update: at the end of ``update_named_params``, of a
    ``weight_update()`` block, or at ``reset_prefix_cache()`` (which TRL calls
    after every sync; the commit has already reset the cache).
    """

    def __init__(self, base_url: str | None = None, host: str = "0.0.0.0", server_port: int = 8000,
                 group_port: int = 51216, connection_timeout: float = 0.0, api_key: str | None = None,
                 transport: str = "auto", pause: str = "wait"):
        self._api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self._transport = transport
        self._pause = pause
        self._pending: dict[str, torch.Tensor] = {}
        self._in_block = False
        super().__init__(base_url=base_url, host=host, server_port=server_port, group_port=group_port,
                         connection_timeout=connection_timeout)
        if self._api_key:
            self.session.headers["Authorization"] = f"Bearer {self._api_key}"
        self.engine = EngineClient(self.base_url, api_key=self._api_key, transport=transport, progress=False)
        self.policy_version = int(self.engine.status().get("versions", {}).get("policy", 0))
        self.syncs = 0

    # -- TRL asks for these before the first sync ------------------------------------------------------
    def _get(self, url: str, **kwargs: Any) -> dict:
        if self._api_key:  # /v1/models is asked for inside VLLMClient.__init__, before the session has headers
            kwargs.setdefault("headers", {"Authorization": f"Bearer {self._api_key}"})
        return super()._get(url, **kwargs)

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        """No process group: check that the server runs the vllm-specrl routes instead."""
        self.engine.status()

    def get_server_info(self) -> dict:
        """What TRL reads from vLLM's dev-mode ``/server_info``, from ``/specrl/status`` when dev mode is off."""
        status = self.engine.status()
        return {"model_config": {"logprobs_mode": status.get("logprobs_mode")},
                "weight_transfer_config": {"backend": "vllm-specrl"},
                "speculative_config": status.get("speculative_config")}

    def get_world_size(self) -> int:
        workers = self.engine.status().get("workers") or []
        return max(1, len(workers))

    # -- weight sync -----------------------------------------------------------------------------------
    @contextmanager
    def weight_update(self) -> Iterator[None]:
        self._in_block = True
        try:
            yield
        finally:
            self._in_block = False
        self._flush()

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        self._pending[name] = weights.detach()

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]],
                            named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_params:
            self._pending[name] = tensor.detach()
        if not self._in_block:
            self._flush()

    def update_model_params(self, model: torch.nn.Module) -> None:
        self.update_named_params([], model.named_parameters())

    def reset_prefix_cache(self) -> None:
        """Commit what is pending; a commit resets vLLM's prefix cache itself."""
        self._flush()

    def close_communicator(self) -> None:
        self._pending.clear()

    def _flush(self) -> None:
        if not self._pending:
            return
        tensors, self._pending = self._pending, {}
        version = self.policy_version + 1
        self.engine.update_policy(tensors.items(), version=version, pause=self._pause)
        self.policy_version = version
        self.syncs += 1


@contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


class use_specrl:  # noqa: N801 - used like a function (and as a context manager to undo it)
    """Make TRL build :class:`SpecRLVLLMClient` wherever it would build its own ``VLLMClient``.

    ``use_specrl(api_key=..., transport=..., pause=...)`` patches TRL's
    generation module for the rest of the process; ``with use_specrl(): ...``
    undoes it on exit.
    """

    def __init__(self, api_key: str | None = None, transport: str = "auto", pause: str = "wait"):
        options = {"api_key": api_key, "transport": transport, "pause": pause}

        class _Configured(SpecRLVLLMClient):
            def __init__(self, *args: Any, **kwargs: Any):
                super().__init__(*args, **{**options, **kwargs})

        _Configured.__name__ = _Configured.__qualname__ = "SpecRLVLLMClient"
        self._patch = _patched(_trl_vllm_generation, "VLLMClient", _Configured)
        self._patch.__enter__()

    def __enter__(self) -> use_specrl:
        return self

    def __exit__(self, *exc: object) -> None:
        self._patch.__exit__(None, None, None)
