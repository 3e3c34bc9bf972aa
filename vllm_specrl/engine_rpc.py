"""Calls into a running engine that fail, never hang, when its engine core dies, and that reach every
engine core of a data-parallel server (front-end side: the plugin's routes and clients use them)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class EngineDied(RuntimeError):
    """The engine core died while a call to it was pending: its outcome is unknown."""


ENGINE_POLL_S = 0.5
DEATH_GRACE_S = 5.0


async def unless_engine_dies(engine: Any, call: Awaitable[T], what: str) -> T:
    """``await call``, or raise ``EngineDied`` as soon as ``engine.errored`` says the core is gone.

    vLLM 0.32.0 (checked in ``core_client.py``; 0.33.0 reads the same): a utility call
    (``collective_rpc``, ``pause_generation``...) that is pending when the engine core process
    dies is never answered: its future stays in ``utility_results``, nothing fails it, so the
    ``await`` hangs forever, and the API server, shutting down after the death, waits for that
    open connection. A weight update whose engine was killed mid-commit would hang its caller
    (and a whole fleet's update) instead of failing. ``scripts/repro/repro_rpc_hangs_on_engine_death.py``
    shows it with vLLM alone.

    The same death can also answer first: when a worker process dies, the engine core fails
    the worker's pending future ("Call to collective_rpc method failed: cancelled") and only
    then reports itself dead. A call that fails is therefore given ``DEATH_GRACE_S`` for
    ``errored`` to turn up, so the caller learns the engine died, not that one call failed.
    """
    task = asyncio.ensure_future(call)
    while True:
        done, _ = await asyncio.wait({task}, timeout=ENGINE_POLL_S)
        if done:
            if task.exception() is not None and await _errored_within(engine, DEATH_GRACE_S):
                raise EngineDied(f"the engine core died during {what}") from task.exception()
            return task.result()
        if getattr(engine, "errored", False):
            task.cancel()
            raise EngineDied(f"the engine core died during {what}")


async def _errored_within(engine: Any, seconds: float) -> bool:
    """Whether ``engine.errored`` becomes true within ``seconds``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not getattr(engine, "errored", False):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def collective_rpc_all_engines(engine: Any, method: str, timeout: float, args: tuple = ()) -> list:
    """Every worker's answer, from every engine core of a data-parallel server; ``EngineDied``
    (never a hang) if an engine core dies meanwhile (``unless_engine_dies``).

    vLLM 0.32.0 (0.33.0 reads the same): with ``--data-parallel-size N`` behind one API server
    (``DPLBAsyncMPClient``), ``AsyncLLM.collective_rpc`` sends the call to every engine core but
    returns only the first core's workers' answers, so a refusal from another core (a weight
    update it could not validate or apply) would go unseen. The DP client's own
    ``call_utility_all_async`` returns one answer list per core; they are concatenated here
    (core order, then worker order). One core: ``collective_rpc`` as is.
    """
    return await unless_engine_dies(engine, _collective_rpc_every_core(engine, method, timeout, args), method)


async def _collective_rpc_every_core(engine: Any, method: str, timeout: float, args: tuple) -> list:
    core = getattr(engine, "engine_core", None)
    every = getattr(core, "call_utility_all_async", None)
    if every is not None and len(getattr(core, "core_engines", ())) > 1:
        per_core = await every("collective_rpc", method, timeout, args, None)
        return [answer for answers in per_core for answer in answers]
    return await engine.collective_rpc(method, timeout=timeout, args=args)
