"""The ``vllm.endpoint_plugins`` entry point: ``/specrl/*`` routes on ``vllm serve``.

Routes reach the engine only through the ``EngineClient`` vLLM hands to
``init_state`` (``collective_rpc`` to the worker extension), as vLLM's
endpoint-plugin contract asks. vLLM's own API-key middleware guards only
``/v1``-style prefixes, so these routes check ``--api-key`` / ``VLLM_API_KEY``
themselves and answer 401 without it.

Enable with ``VLLM_PLUGINS=specrl,specrl_http``: once ``VLLM_PLUGINS`` is set
it is an allowlist for every plugin group, so the general plugin must be
named too or it silently stops loading.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from vllm_specrl import instance_state, metrics, plugin, security, switches
from vllm_specrl.compat import engine_config
from vllm_specrl.compat import version as vllm_versions
from vllm_specrl import engine_rpc
from vllm_specrl._log import logger
from vllm_specrl._version import __version__
from vllm_specrl.adaptive import calibration_ids
from vllm_specrl.adaptive import state as adaptive_state
from vllm_specrl.lifecycle import state as lifecycle_state
from vllm_specrl.sync.http.stale_guard import StaleDraftGuard
from vllm_specrl.sync.watch.api_server import watch_engine_client
from vllm_specrl.sync.http.routes import after_policy_commit, build_sync_router, stamp_versions

_gauge = metrics.shared_gauge


def update_capture_gauges(capture: dict | None) -> None:
    """Capture counters as gauges (refreshed whenever /specrl/status is gathered)."""
    if capture is None:
        return
    for key in ("frames_sent", "frames_dropped_queue_full", "frames_dropped_no_peer", "frames_dropped_peer_busy",
                "bytes_sent", "trainer_connected"):
        _gauge(f"specrl_capture_{key}", f"capture {key.replace('_', ' ')}").set(float(capture.get(key) or 0))


def update_gauges(state: SpecRLHttpState, extra_reasons: list[str] = ()) -> dict:
    """Prometheus gauges on vLLM's /metrics: the stale-draft flag (with ``extra_reasons``: what the
    workers reported) and ``update_record_gauges``."""
    stale = state.stale_draft()
    if extra_reasons:
        stale = dict(stale, stale=True, reasons=[*stale["reasons"], *extra_reasons])
    _gauge("specrl_draft_stale", "1 when the draft no longer helps (see /specrl/status)").set(
        1 if stale["stale"] else 0)
    update_record_gauges(state)
    return stale


def update_record_gauges(state: SpecRLHttpState) -> None:
    """The gauges read from the record every API server shares (versions, the trainer's report) and
    from the engine cores' adaptive-k files, so every API server shows the same values; set before each
    /metrics scrape. The stale-draft flag is not among them: it needs the workers' answers, and is set
    when status is gathered or a commit lands."""
    versions = state.versions
    _gauge("specrl_policy_version", "policy weight version being served").set(versions["policy"])
    _gauge("specrl_draft_version", "draft weight version being served").set(versions["draft"])
    update_trainer_gauges(state.draft_trainer)
    update_logprob_gauges(state.shared.read().get("logprob_conformance"))
    adaptive_state.export_gauges()
    lifecycle_state.export_gauges()


def update_logprob_gauges(report: dict | None) -> None:
    """``specrl_logprob_abs_diff{stat}``: the policy trainer's last |trainer logprob - served logprob| over
    its on-policy tokens (an alert on ``max`` catches a logprob path that went lossy)."""
    if not report:
        return
    gauge = _gauge("specrl_logprob_abs_diff", "the policy trainer's |its logprob - vLLM's| over the last step's "
                   "on-policy tokens (GRPOLoop's report)", ("stat",))
    for stat in ("max", "mean"):
        if isinstance(report.get(stat), (int, float)):
            gauge.labels(stat=stat).set(float(report[stat]))


def update_trainer_gauges(report: dict | None) -> None:
    """The online trainer's capture counts and publish-gate verdicts (from its last report)."""
    if not report:
        return
    capture = report.get("capture") if isinstance(report.get("capture"), dict) else {}
    outcomes = {"ingested": capture.get("ingested", 0), "partial": capture.get("partial", 0),
                "prefix_cached": capture.get("prefix_cached", 0)}
    drops = capture.get("drops") if isinstance(capture.get("drops"), dict) else {}
    outcomes.update({f"dropped_{k}": v for k, v in drops.items()})
    gauge = _gauge("specrl_draft_trainer_requests", "captured requests the online draft trainer "
                   "ingested or dropped, by outcome (from its last publish)", ("outcome",))
    for outcome, value in outcomes.items():
        if isinstance(value, (int, float)):
            gauge.labels(outcome=str(outcome)).set(float(value))
    gate = report.get("publish_gate") if isinstance(report.get("publish_gate"), dict) else {}
    gate_gauge = _gauge("specrl_draft_publish_gate", "the online trainer's publish-gate verdicts: "
                        "better (published), not_better and too_few_held_out (served draft kept)", ("verdict",))
    for verdict in ("better", "not_better", "too_few_held_out"):
        if isinstance(gate.get(verdict), (int, float)):
            gate_gauge.labels(verdict=verdict).set(float(gate[verdict]))


WORKER_RPC_TIMEOUT_S = 30.0
EXTENSION_HINT = "start vllm serve with --worker-extension-cls vllm_specrl.sync.SpecRLWorkerExtension"


SHARED_DEFAULTS: dict[str, Any] = {
    "versions": {"policy": 0, "draft": 0},
    "uploads": {},  # update_id -> {target, version, t0, last, committing?}
    "abandoned_updates": [],
    "abandoned_updates_total": 0,
    "last_commit_failure": None,
    "draft_trainer": None,  # the online trainer's last report (with its publishes)
    "logprob_conformance": None,  # the policy trainer's last |its logprobs - the served ones| (GRPOLoop)
    "guard_window_start": None,  # the spec-decode counters at the last policy change
}
ABANDONED_KEPT = 10


class SpecRLHttpState:
    """Per-app state: the engine client, hashed API keys, and the record every API server of this
    ``vllm serve`` shares (``instance_state``): versions, open uploads, failures, the trainer's
    report, the stale-draft guard's window; commits take a lock that excludes the other processes."""

    def __init__(self, engine_client: Any, api_keys: list[str], allow_unauthenticated_remote: bool = False,
                 update_idle_timeout_s: float = 300.0, directory: Path | None = None, shared_staging: bool = True):
        self.engine_client = engine_client
        self._key_hashes = [hashlib.sha256(k.encode()).digest() for k in api_keys]
        self.allow_unauthenticated_remote = allow_unauthenticated_remote
        several = instance_state.several_api_servers()
        if directory is None:
            directory = instance_state.instance_dir()
            if not several:
                instance_state.own_instance_dir_cleanup()
        self.shared = instance_state.SharedRecord(directory / "api-servers.json", SHARED_DEFAULTS, fresh=not several)
        # An update with no begin/upload/prepare call for this long was abandoned by its client
        # (a trainer or RL driver that died mid-publish): the next begin aborts it.
        self.update_idle_timeout_s = update_idle_timeout_s
        self.commit_lock = instance_state.ProcessLock(directory / "commit.lock")
        self.shared_staging = shared_staging
        self.ranks_read_shm: bool | None = None  # asked on the first HTTP chunk (routes.ranks_read_shm)
        self.guard = StaleDraftGuard()
        spec = getattr(getattr(engine_client, "vllm_config", None), "speculative_config", None)
        # "mtp": the policy's own MTP layers draft; they change with every policy update.
        self.draft_is_policy = getattr(spec, "method", None) == "mtp"
        self.has_draft = getattr(spec, "method", None) in ("eagle3", "eagle", "draft_model", "mtp")

    # -- the shared record (read: a stat; changed: under its lock) ----------------------
    @property
    def versions(self) -> dict[str, int]:
        return dict(self.shared.read().get("versions") or SHARED_DEFAULTS["versions"])

    @property
    def uploads(self) -> dict[str, dict]:
        return dict(self.shared.read().get("uploads") or {})

    @property
    def abandoned_updates(self) -> list[dict]:
        return list(self.shared.read().get("abandoned_updates") or [])

    @property
    def last_commit_failure(self) -> dict | None:
        return self.shared.read().get("last_commit_failure")

    @property
    def draft_trainer(self) -> dict | None:
        return self.shared.read().get("draft_trainer")

    def adopt_versions(self, served: dict[str, int]) -> None:
        """What the workers serve becomes what every API server reports; a policy change starts the
        guard's new acceptance window."""
        current = self.versions
        if all(current.get(k) == v for k, v in served.items()):
            return  # nothing moved: no write (status calls this on every read)
        counters = metrics.from_prometheus_registry()
        with self.shared.changing() as record:
            if served.get("policy", record["versions"]["policy"]) != record["versions"]["policy"]:
                record["guard_window_start"] = counters.summary()
            record["versions"] = {**record["versions"], **served}

    def upload_opened(self, update_id: str, target: str, version: Any) -> None:
        now = time.time()
        with self.shared.changing() as record:
            record["uploads"][update_id] = {"target": target, "version": version, "t0": now, "last": now}

    def upload_touched(self, update_id: str, committing: bool = False) -> None:
        with self.shared.changing() as record:
            if update_id in record["uploads"]:
                record["uploads"][update_id]["last"] = time.time()
                if committing:
                    record["uploads"][update_id]["committing"] = True

    def upload_closed(self, update_id: str) -> dict | None:
        with self.shared.changing() as record:
            return record["uploads"].pop(update_id, None)

    def upload_abandoned(self, entry: dict) -> None:
        with self.shared.changing() as record:
            record["abandoned_updates"] = (record["abandoned_updates"] + [entry])[-ABANDONED_KEPT:]
            record["abandoned_updates_total"] = record.get("abandoned_updates_total", 0) + 1

    async def committed(self, result: dict, pause_mode: str) -> None:
        """Bookkeeping after a worker applied an update (called inside the pause)."""
        if result["target"] == "policy":
            await after_policy_commit(self.engine_client, result, pause_mode)
        # Written before generation resumes: a request any API server answers after this commit says so.
        self.adopt_versions({result["target"]: result["version"]})
        update_gauges(self)

    async def commit_failed(self, result: dict) -> None:
        """A commit failed while applying (the workers restored the last good weights): KV
        computed while some layers were new must not be reused, and status must say so."""
        with self.shared.changing() as record:
            record["last_commit_failure"] = {k: result.get(k) for k in ("error", "rolled_back", "failure",
                                                                         "no_rollback_point")}
        try:
            await self.engine_client.reset_prefix_cache(reset_running_requests=True)
        except Exception as exc:  # noqa: BLE001 - the failure is already reported
            logger.warning("vllm-specrl: prefix cache not reset after a failed commit: %r", exc)

    def trainer_reported(self, report: dict) -> None:
        """The online trainer's capture counts: what it ingested and what it dropped, by reason."""
        with self.shared.changing() as record:
            record["draft_trainer"] = dict(report, received_at=time.time())
        update_trainer_gauges(self.draft_trainer)

    def logprobs_reported(self, report: dict) -> None:
        """The policy trainer's comparison of the logprobs vLLM returned with its own, for the same tokens."""
        with self.shared.changing() as record:
            record["logprob_conformance"] = dict(report, received_at=time.time())
        update_logprob_gauges(report)

    def stale_draft(self) -> dict:
        record = self.shared.read()
        start = record.get("guard_window_start")
        counters = metrics.from_prometheus_registry()
        window = counters.minus(metrics.SpecDecodeCounters.from_summary(start)) if start else counters
        versions = record.get("versions") or SHARED_DEFAULTS["versions"]
        return self.guard.assess(versions["policy"], versions["draft"], self.has_draft, window,
                                 draft_is_policy=self.draft_is_policy)

    @property
    def auth_required(self) -> bool:
        return bool(self._key_hashes)

    def authorized(self, header: str | None) -> bool:
        if not self._key_hashes:
            return True
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        digest = hashlib.sha256(token.encode()).digest()
        ok = False
        for key in self._key_hashes:
            ok |= secrets.compare_digest(digest, key)
        return ok


UNAUTHENTICATED_REMOTE_REFUSAL = (
    "no API key is set on this server, so /specrl routes that change it (updates, pause, capture) answer "
    "loopback clients only; start vllm serve with --api-key (or VLLM_API_KEY) and send "
    "'Authorization: Bearer <key>', or opt out with --additional-config "
    "'{\"specrl\": {\"allow_unauthenticated_remote\": true}}' or "
    f"{security.UNAUTHENTICATED_REMOTE_ENV}=1")


def _specrl_state(request: Request) -> SpecRLHttpState:
    """The app's state, after the access rules: a key when one is set; without one, only loopback
    clients may change anything (weights, pause, capture) unless the operator opted out."""
    state = getattr(request.app.state, "specrl", None)
    if state is None:
        raise HTTPException(503, "vllm-specrl endpoint plugin not initialised")
    if not state.authorized(request.headers.get("Authorization")):
        raise HTTPException(401, "missing or wrong API key (Authorization: Bearer <key>)")
    client = request.client.host if request.client else None
    if (request.method not in ("GET", "HEAD") and not state.auth_required
            and not state.allow_unauthenticated_remote and not security.is_loopback_host(client)):
        raise HTTPException(403, UNAUTHENTICATED_REMOTE_REFUSAL)
    return state


def ineffective_switches(vllm_config: Any) -> list[str]:
    """The switches set on this server that change nothing here (``switches.ineffective``)."""
    scheduler = getattr(getattr(vllm_config, "scheduler_config", None), "scheduler_cls", None)
    name = scheduler if isinstance(scheduler, str) or scheduler is None else \
        f"{scheduler.__module__}.{scheduler.__qualname__}"
    return switches.ineffective(engine_config.specrl_additional_config(vllm_config), name,
                                getattr(vllm_config, "speculative_config", None))


async def gather_status(state: SpecRLHttpState) -> dict[str, Any]:
    """Everything /specrl/status reports, gathered from every process that has it."""
    engine = state.engine_client
    out: dict[str, Any] = {
        "vllm_specrl": __version__,
        "vllm": vllm_versions.vllm_version(),
        "supported_vllm": vllm_versions.SUPPORTED_RANGE,
        "api_server": {"pid": os.getpid(), "plugin": plugin.state()},
        "speculative_config": None,
        "workers": None,
        "spec_decode": metrics.from_prometheus_registry().summary(),
    }
    if engine is None:
        out["workers_error"] = "no engine (render-only server)"
        return out
    out["speculative_config"] = engine_config.speculative_config_summary(engine.vllm_config)
    out["ineffective_switches"] = ineffective_switches(engine.vllm_config)
    out["logprobs_mode"] = str(engine.vllm_config.model_config.logprobs_mode)
    record = state.shared.read()
    out["api_server"]["several"] = instance_state.several_api_servers()
    out["updates_in_progress"] = record["uploads"]
    out["update_idle_timeout_s"] = state.update_idle_timeout_s
    out["abandoned_updates"] = record["abandoned_updates"]
    out["abandoned_updates_total"] = record.get("abandoned_updates_total", 0)
    out["last_commit_failure"] = record["last_commit_failure"]
    out["draft_trainer"] = record["draft_trainer"]
    out["logprob_conformance"] = record.get("logprob_conformance")
    out["adaptive_k"] = adaptive_state.read()  # None unless --scheduler-cls ...AdaptiveKScheduler
    out["drafter"] = drafter_status(lifecycle_state.export_gauges())
    is_paused = getattr(engine, "is_paused", None)
    out["generation_paused"] = bool(await is_paused()) if callable(is_paused) else None
    try:
        out["workers"] = await asyncio.wait_for(
            engine_rpc.collective_rpc_all_engines(engine, "specrl_status", WORKER_RPC_TIMEOUT_S),
            WORKER_RPC_TIMEOUT_S + 5,
        )
        state.adopt_versions(out["workers"][0]["sync"]["versions"])  # a native update may have moved them
        captures = [w["capture"] for w in out["workers"] if w.get("capture")]
        out["capture"] = captures[0] if captures else None
        update_capture_gauges(out["capture"])
    except Exception as exc:  # noqa: BLE001 - status must answer even when workers cannot
        out["workers_error"] = f"{type(exc).__name__}: {exc} ({EXTENSION_HINT})"
    out["versions"] = dict(state.versions)
    out["stale_draft"] = update_gauges(state, draft_mismatches(out["workers"]))
    return out


def drafter_status(states: dict[int, dict]) -> dict | None:
    """The drafter's lifecycle as status shows it: ``draft_collapsed`` and ``refusing`` (true on any engine
    core), repairs summed, and every core's state (``engines``)."""
    if not states:
        return None
    repairs: dict[str, int] = {}
    for state in states.values():
        for cause, n in state["repairs"].items():
            repairs[cause] = repairs.get(cause, 0) + n
    return {"draft_collapsed": any((s.get("collapse") or {}).get("active") for s in states.values()),
            "refusing": any(s["refusing"] is not None for s in states.values()),
            "repairs": repairs, "repairs_total": sum(repairs.values()),
            "on_damage": states[min(states)]["on_damage"], "engines": {str(r): s for r, s in states.items()}}


def draft_mismatches(workers: list[dict] | None) -> list[str]:
    """Workers whose drafter's weights changed without a draft update (``sync.watch.worker_loads``)."""
    return [f"the draft's weights changed without a draft update (after {m['after']}, rank {w.get('rank')}): "
            "publish a draft to replace them" for w in workers or []
            if (m := (w.get("weight_watch") or {}).get("draft_mismatch"))]


def build_router() -> APIRouter:
    router = APIRouter(prefix="/specrl", tags=["vllm-specrl"])

    @router.get("/status")
    async def status(request: Request) -> JSONResponse:
        return JSONResponse(await gather_status(_specrl_state(request)))

    @router.post("/calibrate")
    async def calibrate(request: Request) -> JSONResponse:
        """The secret that marks the start-up sweep's requests (``adaptive.calibration_ids``), for a caller
        that passes the routes' access rules: a request id no other client can forge."""
        _specrl_state(request)
        token = calibration_ids.token()
        if not token:
            return JSONResponse({"ok": False, "error": "no calibration token in this process: the vllm-specrl "
                                                       "plugin did not run here (VLLM_PLUGINS)"}, status_code=503)
        return JSONResponse({"ok": True, "token": token})

    @router.post("/draft_trainer")
    async def draft_trainer(request: Request) -> JSONResponse:
        """The online trainer's report between publishes: a publish gate that keeps the served draft
        sends no update, so its counts would otherwise never reach /status and /metrics."""
        state = _specrl_state(request)
        body = await request.json() if await request.body() else None
        if not isinstance(body, dict):
            return JSONResponse({"error": "the trainer report must be a JSON object"}, status_code=400)
        state.trainer_reported(body)
        return JSONResponse({"ok": True})

    @router.post("/logprobs")
    async def logprobs(request: Request) -> JSONResponse:
        """The policy trainer's logprob comparison (``{"max", "mean", "tokens", "step", ...}``), for status,
        /metrics and an alert."""
        state = _specrl_state(request)
        body = await request.json() if await request.body() else None
        if not isinstance(body, dict) or not isinstance(body.get("max"), (int, float)):
            return JSONResponse({"error": "the logprob report must be a JSON object with a number 'max'"},
                                status_code=400)
        state.logprobs_reported(body)
        return JSONResponse({"ok": True})

    @router.post("/capture")
    async def capture(request: Request) -> JSONResponse:
        """Start (``{"enabled": true, "address"?, "fraction"?}``) or stop hidden-state capture."""
        state = _specrl_state(request)
        body = await request.json() if await request.body() else {}
        if body.get("enabled", True):
            results = await engine_rpc.collective_rpc_all_engines(
                state.engine_client, "specrl_capture_start", WORKER_RPC_TIMEOUT_S,
                (body.get("address"), body.get("fraction")))
        else:
            results = await engine_rpc.collective_rpc_all_engines(state.engine_client, "specrl_capture_stop",
                                                                   WORKER_RPC_TIMEOUT_S)
        bad = [r for r in results if not r.get("ok")]
        return JSONResponse(bad[0] if bad else results[0], status_code=400 if bad else 200)

    return router


class SpecRLEndpointPlugin:
    """Satisfies vLLM's ``EndpointPlugin`` protocol."""

    name = "specrl_http"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(build_router())
        app.include_router(build_sync_router(_specrl_state))

        @app.exception_handler(engine_rpc.EngineDied)
        async def engine_died(request: Request, exc: engine_rpc.EngineDied) -> JSONResponse:
            return JSONResponse({"ok": False, "engine_dead": True, "problems": [],
                                 "error": f"{exc}; this engine serves nothing more and must be restarted"},
                                status_code=503)

        @app.middleware("http")
        async def specrl_versions(request: Request, call_next):  # noqa: ANN202 - Starlette hook
            state = getattr(request.app.state, "specrl", None)
            if state is not None and request.url.path.startswith("/metrics"):
                update_record_gauges(state)  # this process's gauges from the shared record, before the scrape
            return await stamp_versions(request, call_next, state)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        keys = [k for k in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if k]
        specrl_cfg = engine_config.specrl_additional_config(engine_client.vllm_config)
        state.specrl = SpecRLHttpState(engine_client, keys, security.unauthenticated_remote_allowed(
            bool(specrl_cfg.get("allow_unauthenticated_remote", False))),
            update_idle_timeout_s=float(specrl_cfg.get("update_idle_timeout_s", 300.0)),
            shared_staging=bool(specrl_cfg.get("shared_staging", True)))
        update_gauges(state.specrl)
        watch_engine_client(state.specrl)
        for problem in ineffective_switches(engine_client.vllm_config):
            logger.warning("vllm-specrl: a switch without effect: %s", problem)
        capture = specrl_cfg.get("capture")
        if capture:
            try:
                res = await engine_rpc.collective_rpc_all_engines(engine_client, "specrl_capture_start",
                                                                   WORKER_RPC_TIMEOUT_S)
                logger.info("vllm-specrl capture to %s: %s", capture, res)
            except Exception as exc:  # noqa: BLE001 - serving goes on without capture
                logger.warning("vllm-specrl: capture not started (%s): %r", EXTENSION_HINT, exc)
        logger.info("vllm-specrl %s routes at /specrl (api key %s)", __version__,
                    "required" if keys else "not set: control routes answer loopback clients only"
                    if not state.specrl.allow_unauthenticated_remote else "not set: open to every client")


def endpoint_plugin() -> SpecRLEndpointPlugin:
    """Entry point factory (zero arguments, as vLLM calls it)."""
    return SpecRLEndpointPlugin()
