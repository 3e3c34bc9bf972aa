"""``EngineClient``: what an RL trainer calls to push policy and draft weights into ``vllm serve``.

    client = EngineClient("http://127.0.0.1:8000", api_key=...)
    client.update_policy(model.named_parameters(), version=step)   # HF names
    client.update_draft(draft_state_dict, version=step)
    client.status()["stale_draft"]

The transport is chosen per call: shared memory (a safetensors file on
/dev/shm handed over by path) when the engine runs on this host, else
safetensors bodies over HTTP, in chunks of ``chunk_bytes``. Either way the
engine validates every tensor before applying any, so a refused update
raises ``WeightSyncError`` (with the engine's list of offending tensors) and
the engine keeps serving the previous version. An update begun while another
writer's update is open (the RL loop's policy while the online trainer publishes
a draft) waits for it, up to ``begin_wait_s``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlparse

import requests
import torch
from tqdm import tqdm

from vllm_specrl.sync.clients import response_check
from vllm_specrl.sync import shm

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}
DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_BEGIN_WAIT_S = 120.0


class WeightSyncError(RuntimeError):
    """The engine refused an update (nothing was applied); ``problems`` names the tensors."""

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = problems or []
        super().__init__(message)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def chunked(named: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int
            ) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
    """Chunks of about ``chunk_bytes`` (at least one tensor each), with their sizes."""
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named:
        chunk[name] = tensor.detach()
        size += nbytes(tensor)
        if size >= chunk_bytes:
            yield chunk, size
            chunk, size = {}, 0
    if chunk:
        yield chunk, size


class EngineClient:
    """Trainer-side client for one ``vllm serve`` running the vllm-specrl plugins."""

    def __init__(self, url: str, api_key: str | None = None, transport: str = "auto",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, timeout: float = 600.0,
                 progress: bool = True, begin_wait_s: float = DEFAULT_BEGIN_WAIT_S):
        if transport not in ("auto", "shm", "http"):
            raise ValueError(f"transport must be auto, shm or http; got {transport!r}")
        self.url = url.rstrip("/")
        self.session = requests.Session()
        api_key = api_key if api_key is not None else os.environ.get(response_check.API_KEY_ENV)
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.transport = transport
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self.progress = progress
        self.begin_wait_s = begin_wait_s
        self._auto: str | None = None  # what "auto" resolved to (probed once)

    # -- plumbing ---------------------------------------------------------------------------
    def _post(self, path: str, **kwargs: Any) -> dict:
        r = self.session.post(self.url + path, timeout=self.timeout, **kwargs)
        response_check.raise_if_missing(r)
        try:
            body = r.json()
        except ValueError:
            body = {"ok": False, "error": r.text}
        if r.status_code != 200 or not body.get("ok", False):
            detail = body.get("error") or body.get("detail") or r.text
            raise WeightSyncError(f"{path}: HTTP {r.status_code}: {detail}", body.get("problems"))
        return body

    def resolved_transport(self) -> str:
        """``shm`` when asked, or (``auto``) when the engine is on this host and every worker reads a
        probe file written here (asked once per client); ``http`` otherwise."""
        if self.transport != "auto":
            return self.transport
        if self._auto is None:
            host = urlparse(self.url).hostname or ""
            local = host in LOCAL_HOSTS or host == socket.gethostname()
            self._auto = "shm" if local and shm.shm_available() and self.engine_reads_shm() else "http"
        return self._auto

    def engine_reads_shm(self) -> bool:
        """Whether every worker of the engine reads what this process writes to shared memory."""
        path, token = shm.write_probe()
        try:
            return bool(self._post("/specrl/shm/probe", json={"path": str(path), "token": token}).get("shared"))
        except WeightSyncError:
            return False
        finally:
            path.unlink(missing_ok=True)

    def _native(self, path: str, **body: Any) -> None:
        """One of vLLM's own weight-transfer routes (``VLLM_SERVER_DEV_MODE=1``); a refusal raises with
        the engine's reason."""
        r = self.session.post(self.url + path, json=body or None, timeout=self.timeout)
        if r.status_code != 200:
            raise WeightSyncError(f"{path}: HTTP {r.status_code}: {r.text[:2000]}")

    # -- vLLM's native weight-transfer API (the VLLMWeightSyncClient protocol its trainer engines drive) --
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._native("/init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self._native("/start_weight_update")

    def start_draft_weight_update(self) -> None:
        self._native("/start_draft_weight_update")

    def update_weights(self, update_info: dict | list) -> None:
        self._native("/update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._native("/finish_weight_update", **({"weight_version": weight_version} if weight_version else {}))

    # -- public API ----------------------------------------------------------------------------
    def status(self) -> dict:
        r = self.session.get(self.url + "/specrl/status", timeout=self.timeout)
        response_check.raise_for_status(r)
        return r.json()

    def calibrate_adaptive_k(self, max_batch: int = 16, steps: int = 256) -> dict:
        """Measure every k's step cost at each batch size up to ``max_batch`` before the rollouts
        (``vllm_specrl.adaptive.k_sweep``); on an engine without adaptive k, a warm-up."""
        from vllm_specrl.adaptive.k_sweep import calibrate

        auth = self.session.headers.get("Authorization", "")
        return calibrate(self.url, max_batch=max_batch, steps=steps,
                         api_key=auth.removeprefix("Bearer ") or None, timeout_s=self.timeout)

    def pause(self, mode: str = "keep") -> dict:
        return self._post("/specrl/pause", json={"mode": mode})

    def resume(self) -> dict:
        return self._post("/specrl/resume")

    def update_policy(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict, version: int,
                      pause: str = "keep", keep_mtp: bool = False) -> dict:
        """Replace the served policy in place; returns the engine's commit record. On an engine that
        drafts with the policy's own MTP layers the update carries them too, unless ``keep_mtp``:
        then it is the body alone and the served MTP layers stay (an online trainer publishes them)."""
        return self._update("policy", named_tensors, version, pause, keep_mtp=keep_mtp)

    def update_draft(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict, version: int,
                     pause: str = "none", trainer_report: dict | None = None) -> dict:
        """Replace the served EAGLE-3 draft in place (never changes sampled distributions).
        ``trainer_report`` (JSON-safe; the online trainer sends its capture counts) is shown in
        the engine's ``/specrl/status`` as ``draft_trainer``."""
        return self._update("draft", named_tensors, version, pause, trainer_report)

    def _update(self, target: str, named_tensors: Any, version: int, pause: str,
                trainer_report: dict | None = None, keep_mtp: bool = False) -> dict:
        t0 = time.perf_counter()
        staged = self.stage(target, named_tensors, version, trainer_report, keep_mtp)
        try:
            result = self.commit(staged, pause)
        except BaseException:
            self.abort(staged)
            raise
        result.update(total_s=round(time.perf_counter() - t0, 4))
        return result

    # -- the phases, for callers that coordinate several engines (``FleetClient``) ----------------
    def report_trainer(self, report: dict) -> dict:
        """Show an online trainer's report in ``/specrl/status`` and ``/metrics`` without an update."""
        return self._post("/specrl/draft_trainer", json=report)

    def report_logprobs(self, report: dict) -> dict:
        """Show the policy trainer's logprob comparison (``{"max", "mean", "tokens", ...}``) in
        ``/specrl/status`` (``logprob_conformance``) and ``/metrics`` (``specrl_logprob_abs_diff``)."""
        return self._post("/specrl/logprobs", json=report)

    def stage(self, target: str, named_tensors: Any, version: int, trainer_report: dict | None = None,
              keep_mtp: bool = False) -> dict:
        """Begin an update and upload every tensor (validated by the engine, nothing applied).
        Returns the handle ``prepare``/``commit``/``abort`` take; on any failure the update is aborted."""
        if isinstance(named_tensors, dict):
            named_tensors = named_tensors.items()
        named = list(named_tensors)
        total = sum(nbytes(t) for _, t in named)
        transport = self.resolved_transport()
        t0 = time.perf_counter()
        begin = {"target": target, "version": version, "wait_s": self.begin_wait_s}
        if trainer_report is not None:
            begin["trainer_report"] = trainer_report
        if keep_mtp:
            begin["keep_mtp"] = True
        uid = self._post("/specrl/update/begin", json=begin)["update_id"]
        staged = {"update_id": uid, "target": target, "version": version, "transport": transport, "bytes": total}
        try:
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"{target} v{version} ({transport})",
                      disable=not self.progress, leave=False) as bar:
                for chunk, size in chunked(named, self.chunk_bytes):
                    self._upload(uid, chunk, transport)
                    bar.update(size)
        except BaseException:
            self.abort(staged)
            raise
        staged["upload_s"] = round(time.perf_counter() - t0, 4)
        return staged

    def prepare(self, staged: dict) -> dict:
        """Every worker of the engine confirms it holds the whole, valid update (nothing applied)."""
        return self._post(f"/specrl/update/{staged['update_id']}/prepare")

    def commit(self, staged: dict, pause: str = "keep") -> dict:
        """Apply on every worker (all or none of them; see the commit route)."""
        result = self._post(f"/specrl/update/{staged['update_id']}/commit", json={"pause": pause})
        result.update(transport=staged["transport"], bytes=staged["bytes"], upload_s=staged.get("upload_s"))
        return result

    def abort(self, staged: dict) -> None:
        """Drop a staged update (best effort: the engine may already have closed it)."""
        try:
            self.session.post(f"{self.url}/specrl/update/{staged['update_id']}/abort", timeout=30)
        except requests.RequestException:
            pass

    def _upload(self, uid: str, chunk: dict[str, torch.Tensor], transport: str) -> None:
        if transport == "shm":
            try:
                path = shm.write_chunk(chunk)
            except OSError:  # shared memory is full (the engine maps staged updates there): this chunk by HTTP
                return self._upload(uid, chunk, "http")
            try:
                self._post(f"/specrl/update/{uid}/shm", json={"path": str(path)})
            finally:
                path.unlink(missing_ok=True)
        else:
            from safetensors.torch import save

            body = save({k: v.cpu().contiguous() for k, v in chunk.items()})
            self._post(f"/specrl/update/{uid}/tensors", data=body,
                       headers={"Content-Type": "application/octet-stream"})
