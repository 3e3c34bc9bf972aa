"""vLLM alone: a ``collective_rpc`` pending when the engine core dies is never answered.

vLLM 0.32.0 (cpu), ``AsyncMPClient._call_utility_async`` parks a future in ``utility_results``
and awaits it; when the engine core process dies, the client marks ``engine_dead`` (so
``AsyncLLM.errored`` turns True within a second) but nothing fails the parked future, so the
``await`` never returns. (Seen first in a server whose worker was killed in a weight commit: the
commit RPC failed properly, the engine core then died on its queued "Executor failed" item, and
the route's ``resume_generation``, sent just before, was left hanging; here the engine core is
killed directly while a slow RPC is pending, which shows the same deterministically.) In an API server that
means a route awaiting a worker RPC (an in-place
weight update, say) hangs for ever, and uvicorn, shutting down after the death, waits on that
open connection. vllm-specrl races every such call against ``errored``
(``vllm_specrl.engine_rpc.unless_engine_dies``). Suggested upstream fix: when the output socket
task sees the engine die, set ``EngineDeadError`` on every future left in ``utility_results``.

    python scripts/repro/repro_rpc_hangs_on_engine_death.py .fixtures/tiny/target

Prints whether the fault is present and exits 1 if it is (0 if the call failed promptly).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process, as `vllm serve` runs it
os.environ.setdefault("VLLM_PLUGINS", "")  # vLLM alone: no vllm-specrl plugin
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

WAIT_S = 60.0


def slow(worker) -> None:
    """Runs in the worker: a utility call that takes a while (a large weight update, say)."""
    time.sleep(10)


async def main(model: str) -> int:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, dtype="float32", enforce_eager=True,
                                                       max_model_len=256))
    t0 = time.monotonic()
    call = asyncio.ensure_future(engine.collective_rpc(slow))
    await asyncio.sleep(2.0)
    core = [p for p in multiprocessing.active_children() if "EngineCore" in p.name]
    print(f"killing {[p.name for p in core]} while the call is pending (an OOM kill, a lost host)")
    for proc in core:
        os.kill(proc.pid, signal.SIGKILL)
    errored_after = None
    while time.monotonic() - t0 < WAIT_S and not call.done():
        await asyncio.sleep(0.2)
        if errored_after is None and engine.errored:
            errored_after = time.monotonic() - t0
    if call.done():
        print(f"the pending collective_rpc answered after {time.monotonic() - t0:.1f} s: {call.exception()!r} "
              "(fault not present)")
        return 0
    print(f"engine.errored became True after {errored_after} s, but the collective_rpc was still pending "
          f"after {WAIT_S:.0f} s: FAULT PRESENT (a pending utility call is never failed when the engine dies)")
    call.cancel()
    engine.shutdown()
    return 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else ".fixtures/tiny/target")))
