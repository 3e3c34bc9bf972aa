"""``EngineGroup``: several engines driven as one through vLLM's native weight-transfer protocol.

vLLM's trainer engines take one ``VLLMWeightSyncClient``; this is one over N engines (each an
``EngineClient``, or anything with the protocol's methods). It gives each engine its own rank offset
in the trainer's group (``init_weight_transfer_engine``), runs every call on all engines at once (a
collective backend needs every receiver in flight together), and makes a round all or nothing: if any
engine refuses its ``update_weights`` (the ``specrl_gloo`` workers validate before applying), the round
is aborted on every other engine before any ``finish_weight_update`` applies it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_specrl.sync.clients.engine_client import DEFAULT_CHUNK_BYTES, WeightSyncError, chunked


class EngineGroupError(WeightSyncError):
    """A round refused by some engines and aborted on all; ``engines`` says which refused and why."""

    def __init__(self, message: str, engines: dict[int, str]):
        self.engines = engines
        super().__init__(message, [f"engine {i}: {why}" for i, why in engines.items()])


class EngineGroup:
    """``clients[i]`` serves ``workers[i]`` worker processes (TP x PP x DP; default 1 each)."""

    def __init__(self, clients: Sequence[Any], workers: Sequence[int] | None = None):
        if not clients:
            raise ValueError("an engine group needs at least one engine")
        self.clients = list(clients)
        self.workers = list(workers) if workers is not None else [1] * len(self.clients)
        if len(self.workers) != len(self.clients):
            raise ValueError("one worker count per engine")

    @property
    def world_size(self) -> int:
        """The trainer's group: rank 0 and every worker of every engine."""
        return 1 + sum(self.workers)

    def _on_all(self, call: Callable[[int, Any], Any]) -> list[BaseException | None]:
        with ThreadPoolExecutor(len(self.clients)) as pool:
            futures = [pool.submit(call, i, client) for i, client in enumerate(self.clients)]
        return [f.exception() for f in futures]

    def _check(self, errors: list[BaseException | None], what: str) -> None:
        failed = {i: str(e) for i, e in enumerate(errors) if e is not None}
        if failed:
            raise EngineGroupError(f"{what} failed on {len(failed)} of {len(self.clients)} engines", failed)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        offsets = [int(init_info.get("rank_offset", 1)) + sum(self.workers[:i]) for i in range(len(self.clients))]
        self._check(self._on_all(lambda i, c: c.init_weight_transfer_engine(dict(init_info, rank_offset=offsets[i]))),
                    "init_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._check(self._on_all(lambda i, c: c.start_weight_update()), "start_weight_update")

    def start_draft_weight_update(self) -> None:
        self._check(self._on_all(lambda i, c: c.start_draft_weight_update()), "start_draft_weight_update")

    def update_weights(self, update_info: dict) -> None:
        """Every engine receives and validates; one refusal aborts the round on the others (their staged
        tensors dropped, their session closed without applying anything)."""
        errors = self._on_all(lambda i, c: c.update_weights(update_info))
        if any(e is not None for e in errors):
            abort = {"abort": True}  # every specrl backend's update info: drop what was staged

            def close(i: int, client: Any) -> None:
                if errors[i] is None:  # a refusing engine's session already ended in vLLM
                    client.update_weights(abort)
                    client.finish_weight_update()
            self._on_all(close)
            self._check(errors, "update_weights (the round was aborted on every engine, nothing applied)")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._check(self._on_all(lambda i, c: c.finish_weight_update(weight_version)), "finish_weight_update")

    def send_shm(self, named_tensors: Any, weight_version: str | None = None, draft: bool = False,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        """One update through every engine's ``specrl_shm`` backend (engines on this host): the chunks are
        written to shared memory once, every engine stages and validates all of them, then every engine
        applies, or none does."""
        from vllm_specrl.sync.shm import write_chunk

        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        paths = []
        try:
            for chunk, _ in chunked(items, chunk_bytes):  # detached there
                paths.append(write_chunk(chunk))
            (self.start_draft_weight_update if draft else self.start_weight_update)()
            self.update_weights({"paths": [str(p) for p in paths]})
            self.finish_weight_update(weight_version)
        finally:
            for path in paths:
                path.unlink(missing_ok=True)
