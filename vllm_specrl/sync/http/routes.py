"""``/specrl/update/*``, ``/specrl/pause``, ``/specrl/resume``: weight sync over HTTP, no dev mode.

begin -> upload chunks (safetensors bodies, or a shared-memory file path) ->
commit. The worker stages and validates everything; the commit pauses
generation as the caller asks (vLLM's modes: ``wait`` lets in-flight requests
finish on the old weights, ``keep`` freezes them and, after the commit, resumes
them by recomputing their KV on the new weights, ``abort`` ends them; ``none``
applies between two engine steps, in-flight requests recomputed as with
``keep``), applies the weights in place, resets the prefix cache (old-weight KV
never serves a token after a commit), sets vLLM's weight version (so
``/inference/v1/generate`` reports per-token ``weight_versions``) and resumes.

One update is open at a time. Two writers are normal in RL (the policy trainer
and the online draft trainer), so a ``begin`` that finds another update open
waits for it, up to the ``wait_s`` it names, before it is refused (409).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_specrl import engine_rpc
from vllm_specrl._log import logger
from vllm_specrl.security import confined_file
from vllm_specrl.sync.all_or_none import failure_after_rollback, first_refusal, needs_rollback
from vllm_specrl.sync import shm
from vllm_specrl.sync.shm import SHM_DIR

PAUSE_MODES = ("wait", "keep", "abort", "none")
RPC_TIMEOUT_S = 600.0
MAX_BEGIN_WAIT_S = 600.0
BEGIN_POLL_S = 0.05


def refused(error: str, problems: list[str] | None = None, status: int = 400) -> JSONResponse:
    return JSONResponse({"ok": False, "error": error, "problems": problems or []}, status_code=status)


async def answers_from_every_rank(engine: Any, method: str, *args: Any) -> list:
    """Every rank's answer (of every data-parallel engine core); ``EngineDied`` if an engine core
    dies meanwhile (never a hang)."""
    return await engine_rpc.collective_rpc_all_engines(engine, method, RPC_TIMEOUT_S, args)


async def one_answer_from_every_rank(engine: Any, method: str, *args: Any) -> dict:
    """A worker method on every rank, answered as one: the first refusal among them, else rank 0's answer."""
    return first_refusal(await answers_from_every_rank(engine, method, *args))


async def commit_on_every_rank(engine: Any, update_id: str) -> dict:
    """Apply on every rank, all or none (``all_or_none``). Rank 0's record, or the first failure."""
    results = await answers_from_every_rank(engine, "specrl_commit_update", update_id)
    if all(r.get("ok") for r in results):
        await answers_from_every_rank(engine, "specrl_finalize_commit", update_id)
        return results[0]
    undone = (await answers_from_every_rank(engine, "specrl_rollback_commit", update_id)
              if needs_rollback(results) else None)
    return failure_after_rollback(results, undone)


async def after_policy_commit(engine: Any, result: dict, pause_mode: str) -> None:
    """KV computed with the old weights must not serve anything after a policy commit. With requests still
    holding blocks ("keep" froze them, "none" never stopped them) vLLM resets only if they are preempted:
    they resume by recomputing on the new weights. Then vLLM's weight version names the commit."""
    in_flight = pause_mode in ("keep", "none")
    result["prefix_cache_reset"] = bool(await engine.reset_prefix_cache(reset_running_requests=in_flight))
    result["in_flight_recomputed"] = in_flight
    await engine.update_weight_version(str(result["version"]))


async def commit_paused(engine: Any, state: Any, update_id: str, mode: str) -> dict:
    """Prepare on every rank; if all hold the whole update, pause as asked, apply everywhere, resume."""
    prepared = await one_answer_from_every_rank(engine, "specrl_prepare_commit", update_id)
    if not prepared.get("ok"):  # some rank lacks a valid, whole update: nobody applies
        return prepared
    t0 = time.perf_counter()
    if mode != "none":
        await engine_rpc.unless_engine_dies(engine, engine.pause_generation(mode=mode, clear_cache=False), "pause")
    t_paused = time.perf_counter()
    hold = False
    try:
        res = await commit_on_every_rank(engine, update_id)
        if res.get("ok"):
            await state.committed(res, mode)
        else:
            await state.commit_failed(res)
            # Partly applied with no rollback point (policy_rollback: false): never serve that; a
            # complete update (or /specrl/resume, the operator's call) ends the pause.
            hold = bool(res.get("no_rollback_point"))
            if hold and mode == "none":
                await engine_rpc.unless_engine_dies(engine, engine.pause_generation(mode="keep", clear_cache=False),
                                                    "pause")
    finally:
        if not hold and mode != "none" and not getattr(engine, "errored", False):
            await engine_rpc.unless_engine_dies(engine, engine.resume_generation(), "resume")
    if hold:
        res["generation_paused"] = True
    if res.get("ok"):
        res["pause_window_s"] = round(time.perf_counter() - t0, 4)
        res["drain_s"] = round(t_paused - t0, 4)
        logger.info("vllm-specrl: %s v%s committed (%d tensors, %.3f s paused)",
                    res["target"], res["version"], res["tensors_staged"], res["pause_window_s"])
    return res


def abandoned_uploads(state: Any) -> list[tuple[str, dict, float]]:
    """``(update_id, info, idle seconds)`` of open updates whose client went silent for longer
    than the idle timeout. An update being committed is never one (its commit marks it)."""
    now = time.time()
    idle = [(uid, info, now - info.get("last", info["t0"])) for uid, info in state.uploads.items()]
    return [(uid, info, s) for uid, info, s in idle
            if not info.get("committing") and s > state.update_idle_timeout_s]


async def abort_abandoned(state: Any) -> None:
    """Abort, on every rank, abandoned updates: a client that died mid-upload must not block every
    later update."""
    for update_id, info, idle in abandoned_uploads(state):
        if state.upload_closed(update_id) is None:
            continue  # another API server aborted it meanwhile
        res = await one_answer_from_every_rank(state.engine_client, "specrl_abort_update", update_id)
        state.upload_abandoned({"update_id": update_id, "target": info["target"], "version": info["version"],
                                "idle_s": round(idle, 1), "aborted_at": time.time(), "aborted": bool(res.get("ok"))})
        logger.warning("vllm-specrl: update %s (%s v%s) abandoned after %.0f s idle; aborted",
                       update_id, info["target"], info["version"], idle)


async def begin_when_free(state: Any, begin_args: tuple, wait_s: float) -> dict:
    """Begin on every rank (``specrl_begin_update(*begin_args)``); while another update is open, wait
    (up to ``wait_s``) for it to be committed, aborted or abandoned, then try again. Waiting polls this
    process's own record of open uploads, so the engine is asked again only when that record says it is free."""
    deadline = time.monotonic() + wait_s
    while True:
        await abort_abandoned(state)
        res = await one_answer_from_every_rank(state.engine_client, "specrl_begin_update", *begin_args)
        if res.get("ok") or not res.get("busy") or time.monotonic() >= deadline:
            return res
        await asyncio.sleep(BEGIN_POLL_S)
        while state.uploads and time.monotonic() < deadline and not abandoned_uploads(state):
            await asyncio.sleep(BEGIN_POLL_S)


async def every_rank_reads(engine: Any, path: Path, token: str | None) -> tuple[bool, int]:
    """Whether every worker reads ``token`` from the probe file at ``path`` (``shm.write_probe``), and
    how many workers were asked."""
    answers = await answers_from_every_rank(engine, "specrl_read_probe", str(path))
    return bool(token) and all(a.get("token") == token for a in answers), len(answers)


async def ranks_read_shm(state: Any) -> bool:
    """Whether every worker reads this API server's shared memory (asked once per process): then an
    HTTP body is staged from one shared-memory file that every rank maps (``shm.map_file``), not sent
    to each rank to copy. Not across hosts (multi-node tensor parallelism), nor where /dev/shm is not
    writable, nor with ``"shared_staging": false``."""
    if state.ranks_read_shm is None:
        shared = False
        if state.shared_staging and shm.shm_available():
            path, token = shm.write_probe()
            try:
                shared, _ = await every_rank_reads(state.engine_client, path, token)
            except Exception as exc:  # noqa: BLE001 - an older worker: copy per rank, as before
                logger.info("vllm-specrl: ranks not probed for shared memory (%r); staging copies per rank", exc)
            finally:
                path.unlink(missing_ok=True)
        state.ranks_read_shm = shared
    return state.ranks_read_shm


def write_body(body: bytes) -> Path | None:
    """An HTTP chunk written to shared memory as the shm transport would; None when shared memory lacks
    the room (a container's 64 MB /dev/shm): the chunk is then sent to each rank to copy, as before."""
    try:
        return shm.write_bytes(body)
    except OSError as exc:
        logger.info("vllm-specrl: a %d-byte chunk staged per rank, not in shared memory (%r)", len(body), exc)
        return None


def touch(state: Any, update_id: str) -> None:
    state.upload_touched(update_id)


def answer(res: dict) -> JSONResponse:
    return JSONResponse(res, status_code=200 if res.get("ok") else 400)


def build_sync_router(get_state: Callable[[Request], Any]) -> APIRouter:
    """``/specrl/update/*``, ``/specrl/shm/probe``, ``/specrl/pause`` and ``/specrl/resume`` over the
    state ``get_state`` finds for a request (the endpoint plugin's)."""
    router = APIRouter(prefix="/specrl", tags=["vllm-specrl"])
    _add_begin_and_upload_routes(router, get_state)
    _add_prepare_commit_abort_routes(router, get_state)
    _add_pause_routes(router, get_state)
    return router


def _add_begin_and_upload_routes(router: APIRouter, get_state: Callable[[Request], Any]) -> None:
    @router.post("/update/begin")
    async def begin(request: Request) -> JSONResponse:
        state = get_state(request)
        body = await request.json()
        target, version = body.get("target"), body.get("version")
        try:
            wait_s = min(max(float(body.get("wait_s", 0.0)), 0.0), MAX_BEGIN_WAIT_S)
        except (TypeError, ValueError):
            return refused(f"wait_s must be a number of seconds; got {body.get('wait_s')!r}")
        res = await begin_when_free(state, (target, version, body.get("update_id") or uuid.uuid4().hex[:12],
                                            bool(body.get("keep_mtp", False))), wait_s)
        if res.get("ok"):
            state.upload_opened(res["update_id"], target, version)
        elif res.get("busy"):
            res["error"] += (f" (waited {wait_s:g} s; an update with no upload for "
                             f"{state.update_idle_timeout_s:g} s is aborted by the next begin)")
        if isinstance(body.get("trainer_report"), dict):
            state.trainer_reported(body["trainer_report"])
        return JSONResponse(res, status_code=200 if res.get("ok") else 409 if res.get("busy") else 400)

    @router.post("/update/{update_id}/tensors")
    async def upload_tensors(update_id: str, request: Request) -> JSONResponse:
        """Body: one safetensors-serialised chunk; parsed and validated in the worker."""
        state = get_state(request)
        body = await request.body()
        touch(state, update_id)
        path = write_body(body) if await ranks_read_shm(state) else None  # one host copy every rank maps
        if path is not None:
            try:
                res = await one_answer_from_every_rank(state.engine_client, "specrl_stage_file", update_id,
                                                       str(path), True)
            finally:
                path.unlink(missing_ok=True)
        else:
            res = await one_answer_from_every_rank(state.engine_client, "specrl_stage_bytes", update_id, body)
        touch(state, update_id)
        return answer(res)

    @router.post("/update/{update_id}/shm")
    async def upload_shm(update_id: str, request: Request) -> JSONResponse:
        state = get_state(request)
        raw = (await request.json()).get("path", "")
        try:  # resolved first: "specrl-../x" and symlinks out of the directory are refused
            path = confined_file(raw, SHM_DIR, "specrl-", ".safetensors")
        except ValueError:
            return refused(f"shared-memory chunks must be {SHM_DIR}/specrl-*.safetensors; got {raw!r}")
        touch(state, update_id)
        res = await one_answer_from_every_rank(state.engine_client, "specrl_stage_file", update_id, str(path),
                                               state.shared_staging)
        touch(state, update_id)
        return answer(res)

    @router.post("/shm/probe")
    async def shm_probe(request: Request) -> JSONResponse:
        """Whether every worker reads the client's probe file: the shared-memory transport works only
        when the client and the engine share ``/dev/shm`` (not across containers or hosts)."""
        state = get_state(request)
        body = await request.json()
        raw, token = body.get("path", ""), body.get("token")
        try:
            path = confined_file(raw, SHM_DIR, "specrl-", ".safetensors")
        except ValueError:
            return JSONResponse({"ok": True, "shared": False,
                                 "why": f"the engine reads shared memory in {SHM_DIR}, not {raw!r}"})
        shared, ranks = await every_rank_reads(state.engine_client, path, token)
        return JSONResponse({"ok": True, "shared": shared, "ranks": ranks,
                             **({} if shared else {"why": "a worker cannot read the client's file: another "
                                                         "host or container (its own /dev/shm)"})})


def _add_prepare_commit_abort_routes(router: APIRouter, get_state: Callable[[Request], Any]) -> None:
    @router.post("/update/{update_id}/prepare")
    async def prepare(update_id: str, request: Request) -> JSONResponse:
        """Phase one alone (for a client coordinating several engines): every rank holds the whole,
        valid update; nothing is applied. The commit runs it again."""
        state = get_state(request)
        touch(state, update_id)
        res = await one_answer_from_every_rank(state.engine_client, "specrl_prepare_commit", update_id)
        touch(state, update_id)
        return answer(res)

    @router.post("/update/{update_id}/commit")
    async def commit(update_id: str, request: Request) -> JSONResponse:
        state = get_state(request)
        body = await request.json() if await request.body() else {}
        mode = body.get("pause", "keep")
        if mode not in PAUSE_MODES:
            return refused(f"pause must be one of {PAUSE_MODES}; got {mode!r}")
        engine = state.engine_client
        state.upload_touched(update_id, committing=True)
        async with state.commit_lock:
            try:
                res = await commit_paused(engine, state, update_id, mode)
            except engine_rpc.EngineDied as exc:  # nothing can serve or be restored here: say so at once
                state.upload_closed(update_id)
                logger.error("vllm-specrl: %s; update %s outcome unknown", exc, update_id)
                raise engine_rpc.EngineDied(  # answered 503 by the app's handler (http.py)
                    f"{exc}: update {update_id} may be partly applied; restart from the served checkpoint "
                    "plus the last committed update") from exc
        state.upload_closed(update_id)
        return answer(res)

    @router.post("/update/{update_id}/abort")
    async def abort(update_id: str, request: Request) -> JSONResponse:
        state = get_state(request)
        state.upload_closed(update_id)
        return JSONResponse(await one_answer_from_every_rank(state.engine_client, "specrl_abort_update", update_id))


def _add_pause_routes(router: APIRouter, get_state: Callable[[Request], Any]) -> None:
    @router.post("/pause")
    async def pause(request: Request) -> JSONResponse:
        state = get_state(request)
        mode = (await request.json() if await request.body() else {}).get("mode", "keep")
        if mode not in PAUSE_MODES[:3]:
            return refused(f"mode must be one of {PAUSE_MODES[:3]}; got {mode!r}")
        engine = state.engine_client
        await engine_rpc.unless_engine_dies(engine, engine.pause_generation(mode=mode, clear_cache=False), "pause")
        return JSONResponse({"ok": True, "paused": True, "mode": mode})

    @router.post("/resume")
    async def resume(request: Request) -> JSONResponse:
        state = get_state(request)
        await engine_rpc.unless_engine_dies(state.engine_client, state.engine_client.resume_generation(), "resume")
        return JSONResponse({"ok": True, "paused": False})


async def stamp_versions(request: Request, call_next: Callable, state: Any) -> Any:
    """Policy version at a request's arrival and at its response (OpenAI routes), read from the record
    every API server shares; ``x-specrl-api-server``: the pid of the API server that answered."""
    start = state.versions["policy"] if state else None
    response = await call_next(request)
    if state is not None:
        response.headers["x-specrl-api-server"] = str(os.getpid())
        if request.url.path.startswith("/v1/"):
            response.headers["x-specrl-policy-version-start"] = str(start)
            response.headers["x-specrl-policy-version"] = str(state.versions["policy"])
    return response

